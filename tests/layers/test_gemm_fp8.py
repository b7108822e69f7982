"""The FP8 expert GEMM (emulated GEMM on CPU: the same quantised operands and scale layouts as
torch._scaled_grouped_mm gets on the GPU).

Two references: an independent per-expert loop over explicitly quantised operands (the layouts
and scales must be right: agreement to bf16 output rounding, 1e-2 relative), and the bf16
layer (FP8's own error: e4m3 keeps 3 mantissa bits, so products carry ~2-4% relative error;
the layer must agree within 10% relative, forward and backward)."""

import pytest
import torch

from moe.config import MoEConfig
from moe.kernels.fp8 import pow2_encode_scale
from moe.layers import MoELayer
from moe.layers.gemm import GroupedMM
from moe.layers.gemm_fp8 import Fp8Gemms, Fp8GroupedGemm, Fp8Rule, WeightCache

FP8_VS_BF16 = 0.10  # measured 6.4-6.8% at these sizes (two FP8 GEMMs in series)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fq(t, dim):
    """Quantise-dequantise with power-of-two scales along ``dim`` (the contraction)."""
    enc = pow2_encode_scale(t.float().abs().amax(dim, keepdim=True))
    return (t.float() * enc).clamp(-448, 448).to(torch.float8_e4m3fn).float() / enc


def loop_reference(x, w, counts, grad):
    outs, gxs, gws = [], [], []
    start = 0
    for g, n in enumerate(counts):
        xs, gs = x[start : start + n], grad[start : start + n]
        outs.append(fq(xs, 1) @ fq(w[g], 1).t())
        gxs.append(fq(gs, 1) @ fq(w[g], 0))
        gws.append(fq(gs, 0).t() @ fq(xs, 0) if n else torch.zeros_like(w[g], dtype=torch.float32))
        start += n
    return torch.cat(outs), torch.cat(gxs), torch.stack(gws)


@pytest.mark.parametrize("counts", [[10, 0, 37, 21], [1, 1, 1, 64]])
def test_fp8_gemm_matches_a_per_expert_loop_over_quantised_operands(counts):
    torch.manual_seed(0)
    groups, m, k = len(counts), 48, 32
    x = torch.randn(sum(counts), k).bfloat16().requires_grad_(True)
    w = (torch.randn(groups, m, k) * 0.1).bfloat16().requires_grad_(True)
    grad = torch.randn(sum(counts), m).bfloat16()
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = Fp8GroupedGemm(Fp8Rule(0), emulate=True)(x, w, offsets)
    out.backward(grad)
    ref_out, ref_gx, ref_gw = loop_reference(x.detach(), w.detach(), counts, grad)
    assert rel(out, ref_out) < 1e-2
    assert rel(x.grad, ref_gx) < 1e-2
    assert rel(w.grad, ref_gw) < 1e-2
    assert out.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_fp8_gemm_agrees_with_bf16_and_each_gemm_can_fall_back():
    torch.manual_seed(1)
    counts = [7, 30, 0, 19]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x0 = torch.randn(sum(counts), 64).bfloat16()
    w0 = (torch.randn(4, 32, 64) * 0.1).bfloat16()
    grad = torch.randn(sum(counts), 32).bfloat16()

    def run(gemm):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = gemm(x, w, offsets)
        out.backward(grad)
        return out, x.grad, w.grad

    ref = run(GroupedMM())
    for plan in [Fp8Gemms(True, True, True), Fp8Gemms(True, False, False), Fp8Gemms(False, True, False), Fp8Gemms(False, False, True)]:
        gemm = Fp8GroupedGemm(Fp8Rule(0), emulate=True)
        gemm._plan = lambda x, w, plan=plan: plan
        got = run(gemm)
        for name, a, b, fp8 in zip(("out", "dx", "dw"), got, ref, (plan.fwd, plan.dgrad, plan.wgrad), strict=True):
            err = rel(a, b)
            assert err < FP8_VS_BF16, (plan, name, err)
            if not fp8:
                assert err < 1e-2, (plan, name, err)  # the bf16 GEMM itself


def test_the_rule_keeps_thin_and_short_gemms_in_bf16():
    # the defaults (full-step measurements on an H200, Fp8Rule's docstring): the paper's width goes
    # to FP8 from 1,024 rows per expert (16K tokens x top-4 over 64 experts), not at 512; OLMoE
    # width (GEMMs 2048x2048 and 2048x1024) from 2,048 rows (16K tokens x top-8), not at 1,024
    rule = Fp8Rule()
    assert rule.plan(65536, 64, 8192, 4096) == Fp8Gemms(True, True, True, sink_wgrad=True)
    assert not rule.plan(32768, 64, 8192, 4096).any
    assert rule.plan(131072, 64, 2048, 2048) == Fp8Gemms(True, True, True, sink_wgrad=False)
    assert not rule.plan(65536, 64, 2048, 2048).any
    # a GEMM whose smaller dimension is under 2,048 needs 4,096 rows on its own...
    assert not rule.plan(131072, 64, 2048, 1024).any and rule.plan(262144, 64, 2048, 1024).any
    assert not rule.plan(131072, 64, 1024, 1024).any and rule.plan(262144, 64, 1024, 1024).any
    # ...but a down projection follows its MLP's up projection: OLMoE's (2048 x 1024) goes with
    # its 2048 x 2048 up projection, d = h = 1024's with its 2048 x 1024 one
    assert rule.plan_down(131072, 64, 2048, 1024) == Fp8Gemms(True, True, True, sink_wgrad=False)
    assert rule.plan_down(65536, 64, 4096, 4096) == Fp8Gemms(True, True, True, sink_wgrad=True)
    assert not rule.plan_down(65536, 64, 2048, 1024).any
    assert not rule.plan_down(131072, 64, 1024, 1024).any and rule.plan_down(262144, 64, 1024, 1024).any
    assert not rule.plan_down(1 << 20, 64, 2048, 768).any  # its own dimensions still reach min_dim
    # a hidden size of 768 (contraction of down, output of its dgrad) stays bf16 at any rows
    assert rule.plan(1 << 20, 128, 2048, 768) == Fp8Gemms(False, False, False)
    # a GEMM wide one way and thin the other is decided by its thin side
    assert not Fp8Rule(4096).plan(1 << 20, 64, 8192, 2048).any
    assert Fp8Rule(min_rows=16).plan(1024, 64, 2048, 1024).any  # min_rows overrides both tiers
    assert not Fp8Rule(0).use(4096, 40, 64)  # FP8 operands need multiples of 16


def test_fp8_wgrad_goes_to_the_accumulating_gemm_only_at_the_widest_gemms():
    # measured in the step (Fp8Rule's docstring): FP8 wgrad inside the accumulating GEMM pays at
    # paper width (GEMMs 8192x4096, 4096x4096) and loses at OLMoE width (2048x2048, 2048x1024),
    # where wgrad stays in the bf16 accumulating GEMM while forward and dgrad run in FP8
    rule = Fp8Rule()
    assert rule.plan(65536, 64, 8192, 4096).sink_wgrad and rule.plan_down(65536, 64, 4096, 4096).sink_wgrad
    olmoe_up, olmoe_down = rule.plan(131072, 64, 2048, 2048), rule.plan_down(131072, 64, 2048, 1024)
    assert olmoe_up.wgrad and olmoe_down.wgrad and not olmoe_up.sink_wgrad and not olmoe_down.sink_wgrad
    assert not rule.plan(32768, 64, 8192, 4096).sink_wgrad  # never without FP8 wgrad itself
    assert Fp8Rule(0).plan(64, 4, 32, 16).sink_wgrad  # min_dim 0 forces FP8 everywhere (benchmarks, tests)


@pytest.mark.parametrize("shared", [0, 1])
def test_fp8_moe_layer_matches_the_bf16_layer_forward_and_backward(shared):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=64, num_shared_experts=shared).validate()
    ref = MoELayer(64, cfg).bfloat16()
    ref.reset_parameters(0.05)
    fp8 = MoELayer(64, cfg).bfloat16()
    fp8.load_state_dict(ref.state_dict())
    fp8.experts.gemm = Fp8GroupedGemm(Fp8Rule(0), emulate=True)
    x = torch.randn(2, 48, 64).bfloat16()
    probe = torch.randn(2, 48, 64).bfloat16()
    outs, grads = [], []
    for layer in (ref, fp8):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out.float() * probe.float()).sum().backward()
        outs.append(out)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    assert isinstance(ref.experts.gemm, GroupedMM)
    assert rel(outs[1], outs[0]) < FP8_VS_BF16
    names = ["x"] + [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, grads[1], grads[0], strict=True):
        assert a is not None and torch.isfinite(a).all(), name
        assert rel(a, b) < FP8_VS_BF16, (name, rel(a, b))


def test_weight_copies_are_reused_within_a_version_and_remade_after_an_update():
    cache = WeightCache()
    w = torch.nn.Parameter(torch.randn(2, 32, 16).bfloat16())
    q1, s1 = cache.rows(w)
    assert cache.rows(w)[0] is q1 and cache.cols(w)[0] is cache.cols(w)[0]
    with torch.no_grad():
        w.mul_(2)  # what the optimizer's in-place copy does to the version counter
    q2, s2 = cache.rows(w)
    assert q2 is not q1 and torch.equal(s2, s1 * 2)
    t2, st2 = cache.cols(w)
    wt = w.detach().float().transpose(1, 2)
    assert ((t2.float() * st2[:, :, None] - wt).abs() <= wt.abs() * 2.0**-4 + st2[:, :, None] * 2.0**-9).all()


def test_mxfp8_fake_quantised_gemm_agrees_with_bf16():
    from moe.layers.gemm_fp8 import MxFp8GroupedGemm

    torch.manual_seed(2)
    counts = [9, 0, 23, 32]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    grad = torch.randn(sum(counts), 32).bfloat16()
    x0, w0 = torch.randn(sum(counts), 64).bfloat16(), (torch.randn(4, 32, 64) * 0.1).bfloat16()
    results = []
    for gemm in (GroupedMM(), MxFp8GroupedGemm()):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = gemm(x, w, offsets)
        out.backward(grad)
        results.append((out, x.grad, w.grad))
    for a, b in zip(results[1], results[0], strict=True):
        assert rel(a, b) < FP8_VS_BF16


@pytest.mark.parametrize("min_dim", [0, 10**6])
def test_fp8_experts_on_token_rows_match_the_gathered_path(min_dim):
    """The FP8 experts reading token rows through the routing permutation (tokens quantised once,
    FP8 bytes gathered; the down projection and the combine in one backward that never stores the
    combine's gradient rows) against the same recipe on the materialised expert-ordered copy with
    the dispatcher's combine. Forward: the same bits. Backward: the up projection's weight
    gradient the same bits (same operands), the rest within FP8 rounding of each other (the
    down projection's dgrad quantises grad_out per token and folds the routing weight into the
    row scale instead of quantising the weighted rows). min_dim=10**6: all bf16, equal."""
    from moe.layers.dispatch import combine_rows, sort_by_expert
    from moe.layers.experts import GroupedExperts

    torch.manual_seed(0)
    tokens_n, k, d, h, e = 33, 2, 32, 48, 4
    experts = GroupedExperts(e, d, h, Fp8GroupedGemm(Fp8Rule(min_dim), emulate=True))
    experts.reset_parameters(0.05)
    assert experts.reads_token_rows
    choice = torch.stack([torch.randperm(e)[:k] for _ in range(tokens_n)])
    order, inverse = sort_by_expert(choice.reshape(-1))
    counts = torch.bincount(choice.reshape(-1), minlength=e)
    x = torch.randn(tokens_n, d).bfloat16()
    weights = torch.rand(tokens_n, k)
    probe = torch.randn(tokens_n, d)
    results = []
    for via_tokens in (True, False):
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        if via_tokens:
            state = type("State", (), {"order": order, "inverse": inverse, "weights": wi})()
            out = experts.forward_tokens(xi, state, counts)
        else:
            out = combine_rows(experts(xi.index_select(0, order // k), counts), inverse, wi)
        (out.float() * probe).sum().backward()
        results.append((out.detach(), xi.grad.clone(), wi.grad.clone(), experts.gate_up.grad.clone(), experts.down.grad.clone()))
    (o1, gx1, gw1, gu1, gd1), (o2, gx2, gw2, gu2, gd2) = results
    assert torch.equal(o1, o2)
    if min_dim:
        for a, b in ((gx1, gx2), (gw1, gw2), (gu1, gu2), (gd1, gd2)):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
        return
    torch.testing.assert_close(gw1, gw2, rtol=1e-2, atol=1e-3)  # dot products of the same bf16 rows
    for name, a, b in (("dx", gx1, gx2), ("d_gate_up", gu1, gu2), ("d_down", gd1, gd2)):
        assert rel(a, b) < 0.06, (name, rel(a, b))  # two e4m3 roundings of the same values


def test_fp8_token_path_gradients_agree_with_bf16():
    """The FP8 layer on the token-row path against the bf16 layer: FP8's own error only."""
    layers = {}
    for fp8 in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(32, MoEConfig(num_experts=4, top_k=2, expert_hidden=48))
        layer.reset_parameters(0.05)
        if fp8:
            layer.experts.gemm = Fp8GroupedGemm(Fp8Rule(0), emulate=True)
        layers[fp8] = layer.bfloat16()
    assert layers[True].experts.reads_token_rows and not layers[False].experts.reads_token_rows
    x = torch.randn(2, 13, 32).bfloat16()
    grads = {}
    for fp8, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out.float() * torch.linspace(-1, 1, 32)).sum().backward()
        grads[fp8] = [out.detach(), xi.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads[True], grads[False], strict=True):
        assert rel(a, b) < FP8_VS_BF16, rel(a, b)


class _MixedRule(Fp8Rule):
    """One plan for every GEMM (the default rule gives a projection's three GEMMs the same answer,
    so the per-GEMM bf16 fallbacks are reached only through a rule like this)."""

    def __init__(self, plan):
        super().__init__(0)
        self._fixed = plan

    def plan(self, tokens, groups, out_dim, in_dim):
        return self._fixed


@pytest.mark.parametrize(
    "plan", [Fp8Gemms(True, False, True), Fp8Gemms(False, True, False), Fp8Gemms(True, True, False), Fp8Gemms(False, False, True)]
)
def test_fp8_token_path_with_some_gemms_in_bf16_agrees_with_bf16(plan):
    """Every mix of FP8 and bf16 GEMMs on the token-row path (gathered up projection, the down
    projection with the combine) computes the bf16 layer's function to FP8 precision."""
    results = {}
    for fp8 in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(32, MoEConfig(num_experts=4, top_k=2, expert_hidden=48))
        layer.reset_parameters(0.05)
        if fp8:
            layer.experts.gemm = Fp8GroupedGemm(_MixedRule(plan), emulate=True)
        layer = layer.bfloat16()
        xi = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_(True)
        out = layer(xi)
        (out.float() * torch.linspace(-1, 1, 32)).sum().backward()
        results[fp8] = [out.detach(), xi.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(results[True], results[False], strict=True):
        assert rel(a, b) < FP8_VS_BF16, (plan, rel(a, b))
