import itertools
import math

import pytest
import torch

from moe.config import MoEConfig
from moe.layers import Router


def make_router(d=8, **kw):
    cfg = MoEConfig(**{"num_experts": 6, "top_k": 2, **kw}).validate()
    r = Router(d, cfg)
    r.reset_parameters(1.0)
    return r


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [False, True])
def test_top_k_matches_brute_force(score_func, normalize):
    r = make_router(score_func=score_func, normalize_top_k=normalize, top_k=3)
    x = torch.randn(20, 8)
    out = r(x)
    logits = x.double() @ r.weight.double().T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    for t in range(20):
        best = max(itertools.combinations(range(6), 3), key=lambda s: sum(scores[t, e].item() for e in s))
        assert sorted(out.experts[t].tolist()) == sorted(best)
        expected = scores[t, list(out.experts[t])]
        if normalize:
            expected = expected / expected.sum()
        torch.testing.assert_close(out.weights[t].double(), expected, rtol=1e-5, atol=1e-6)
    assert out.weights.dtype == torch.float32


def hand_router(logit_rows):
    """A router whose logits equal ``logit_rows`` for identity inputs."""
    logits = torch.tensor(logit_rows, dtype=torch.float32)
    e = logits.shape[1]
    r = make_router(d=e, num_experts=e, top_k=1)
    with torch.no_grad():
        r.weight.copy_(torch.eye(e))
    return r(logits)  # x = logits, W = I


def test_balance_and_z_loss_hand_computed():
    ln3 = math.log(3.0)
    balanced = hand_router([[ln3, 0.0], [0.0, ln3]])
    # f = [1/2, 1/2], P = [1/2, 1/2]: E/k * sum f P = 2 * (1/4 + 1/4) = 1
    assert balanced.lb_loss.item() == pytest.approx(1.0)
    skewed = hand_router([[ln3, 0.0], [ln3, 0.0]])
    # f = [1, 0], P = [3/4, 1/4]: 2 * 3/4 = 1.5
    assert skewed.lb_loss.item() == pytest.approx(1.5)
    # z = mean(logsumexp^2) = ln(4)^2 for both tokens
    assert skewed.z_loss.item() == pytest.approx(math.log(4.0) ** 2)
    assert skewed.tokens_per_expert.tolist() == [2, 0]


def test_counts_are_a_histogram_of_choices():
    r = make_router()
    out = r(torch.randn(50, 8))
    assert out.tokens_per_expert.dtype == torch.int64
    assert out.tokens_per_expert.tolist() == torch.bincount(out.experts.flatten(), minlength=6).tolist()
    assert out.tokens_per_expert.sum().item() == 100


def test_random_routing_is_uniform_distinct_and_differentiable():
    r = make_router(routing="random", num_experts=8, top_k=3)
    x = torch.randn(4000, 8)
    out = r(x)
    assert all(len(set(row)) == 3 for row in out.experts.tolist())
    frac = out.tokens_per_expert.float() / out.tokens_per_expert.sum()
    assert (frac - 1 / 8).abs().max() < 0.02
    out.weights.sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_aux_free_bias_moves_towards_balance_and_only_changes_selection():
    r = make_router(num_experts=4, top_k=1, bias_update_rate=0.1)
    r.train()
    with torch.no_grad():
        r.weight.zero_()
        r.weight[0, 0] = 5.0  # expert 0 wins for x[:, 0] > 0
    x = torch.randn(64, 8).abs()
    first = r(x)
    assert first.tokens_per_expert[0] == 64
    r.update_bias()
    # overloaded expert 0 is pushed down, the idle ones up
    assert r.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert r.pending_load.abs().sum() == 0
    # weights are still the raw scores of the chosen experts
    again = r(x)
    scores = (x @ r.weight.T).softmax(-1)
    torch.testing.assert_close(again.weights, scores.gather(-1, again.experts))
    assert "expert_bias" in r.state_dict()


def _input_grads(pass_through: bool):
    """x's gradient when x feeds the router's logits and, gathered, the rows the experts read:
    through the logits' Function (its backward adds into the rows' gradient) or alongside it;
    and the float64 value both round."""
    from moe.layers.router import router_logits

    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    order = torch.randperm(64).repeat(2)  # each token read twice, as top-2 does
    probe, rows_probe = torch.randn(64, 8), torch.randn(128, 32)
    logits, through = router_logits(x, w, pass_through=pass_through)
    rows = (through if pass_through else x).index_select(0, order)
    ((logits * probe).sum() + (rows.float() * rows_probe).sum()).backward()
    g = probe.bfloat16().double()  # the backward rounds the logits' gradient to bf16 first
    gathered = torch.zeros(64, 32, dtype=torch.bfloat16).index_add_(0, order, rows_probe.bfloat16())  # the gather's backward
    exact = g @ w.detach().double() + gathered.double()
    return x.grad, w.grad, exact


def test_the_input_gradient_through_the_router_is_autograds_sum_rounded_once():
    """MoELayer reads the tokens it gathers through the router's logits Function, whose backward
    adds the logits' input gradient into the gather's (in the GEMM): autograd's sum of the two,
    rounded once instead of twice, and the weight's gradient the same bits."""
    folded, folded_w, exact = _input_grads(pass_through=True)
    summed, summed_w, _ = _input_grads(pass_through=False)
    assert torch.equal(folded_w, summed_w)
    assert not torch.equal(folded, summed)  # the fold ran
    err_folded, err_summed = (folded.double() - exact).abs().max(), (summed.double() - exact).abs().max()
    assert err_folded <= err_summed, (err_folded, err_summed)
    torch.testing.assert_close(folded.double(), exact, rtol=2**-8, atol=1e-6)  # one rounding: half a bf16 ulp


def test_the_moe_layer_gathers_through_the_router_only_where_the_fold_is_safe():
    from moe.config import MoEConfig
    from moe.layers import MoELayer

    layer = MoELayer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=8).validate()).to(torch.bfloat16)
    seen = []
    layer.dispatcher.dispatch = lambda x, routing, inner=layer.dispatcher.dispatch: seen.append(x.grad_fn) or inner(x, routing)
    layer(torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    assert type(seen[0]).__name__ == "_RouterLogitsBackward"
    assert layer.router(torch.randn(4, 16, dtype=torch.bfloat16)).tokens is None  # not asked: no pass-through
    assert layer.router.float()(torch.randn(4, 16), fold_input_grad=True).tokens is None  # fp32: F.linear, nothing to fold
