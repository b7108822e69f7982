import pytest
import torch

from moe.config import MoEConfig
from moe.layers import MoELayer
from moe.layers.reference import reference_experts_combine


def build(d, **kw):
    cfg = MoEConfig(**kw).validate()
    layer = MoELayer(d, cfg)
    layer.reset_parameters(0.2)
    return layer


def reference(layer, x):
    routing = layer.router(x)
    out = reference_experts_combine(x, routing.experts, routing.weights, layer.experts.gate_up, layer.experts.down)
    if layer.shared is not None:
        out = out + layer.shared(x)
    return out, routing


def grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


CASES = [
    # (tokens, d_model, hidden, experts, top_k)
    (1, 8, 8, 4, 1),
    (3, 16, 8, 16, 1),  # most experts get no tokens
    (37, 24, 40, 8, 2),
    (64, 32, 16, 5, 5),  # every expert for every token
    (50, 16, 24, 12, 3),
]


@pytest.mark.parametrize("tokens, d, hidden, experts, k", CASES)
@pytest.mark.parametrize("shared", [0, 1])
def test_layer_matches_per_expert_loop_forward_and_backward(tokens, d, hidden, experts, k, shared):
    torch.manual_seed(tokens * 31 + experts)
    layer = build(d, num_experts=experts, top_k=k, expert_hidden=hidden, num_shared_experts=shared).eval()
    x = torch.randn(tokens, d, requires_grad=True)
    probe = torch.randn(tokens, d)

    out = layer(x)
    (out * probe).sum().backward()
    fast = [g.clone() for g in grads(layer, x)]
    layer.zero_grad()
    x.grad = None

    ref, _ = reference(layer, x)
    (ref * probe).sum().backward()
    slow = grads(layer, x)

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_layer_is_built_with_the_expert_gemm_it_is_given():
    """One selector, at build (moe.precision's recipe gives it); torch's grouped GEMM by default."""
    from moe.layers import GroupedMM

    assert type(build(8, num_experts=4, top_k=2, expert_hidden=8).experts.gemm) is GroupedMM

    class Marked(GroupedMM):
        pass

    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8)
    assert type(MoELayer(8, cfg, Marked).experts.gemm) is Marked


def test_empty_experts_get_zero_gradient():
    layer = build(16, num_experts=16, top_k=1, expert_hidden=8).eval()
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).square().sum().backward()
    counts = layer.last_stats.tokens_per_expert
    idle = counts == 0
    assert idle.sum() >= 13
    assert layer.experts.gate_up.grad[idle].abs().sum() == 0
    assert layer.experts.gate_up.grad[~idle].abs().sum() > 0


def test_sum_backward_with_stride_zero_gradient_works():
    layer = build(16, num_experts=4, top_k=2, expert_hidden=8)
    x = torch.randn(2, 5, 16, requires_grad=True)
    layer(x).sum().backward()  # grouped_mm rejects stride-0 grads; the layer must not pass one
    assert x.grad.shape == x.shape


def test_training_mode_adds_exactly_the_weighted_aux_losses_to_gradients():
    layer = build(16, num_experts=6, top_k=2, expert_hidden=8, lb_loss_weight=0.3, z_loss_weight=0.05).train()
    layer.aux_loss_scale = 0.5
    x = torch.randn(20, 16, requires_grad=True)
    probe = torch.randn(20, 16)
    (layer(x) * probe).sum().backward()
    fast = [g.clone() for g in grads(layer, x)]
    layer.zero_grad()
    x.grad = None

    ref, routing = reference(layer, x)
    ((ref * probe).sum() + 0.5 * (0.3 * routing.lb_loss + 0.05 * routing.z_loss)).backward()
    for a, b in zip(fast, grads(layer, x), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_telemetry_counts_and_losses_are_device_tensors():
    layer = build(16, num_experts=4, top_k=2, expert_hidden=8)
    x = torch.randn(2, 9, 16)
    layer(x)
    stats = layer.last_stats
    assert stats.tokens_per_expert.sum().item() == 18 * 2
    assert stats.lb_loss.ndim == 0 and not stats.lb_loss.requires_grad
    assert stats.z_loss.item() > 0


def test_bf16_layer_runs_and_is_close_to_fp32():
    layer = build(32, num_experts=8, top_k=2, expert_hidden=16).eval()
    x = torch.randn(40, 32)
    ref = layer(x)
    layer_bf16 = build(32, num_experts=8, top_k=2, expert_hidden=16).eval()
    layer_bf16.load_state_dict(layer.state_dict())
    layer_bf16.to(torch.bfloat16)
    out = layer_bf16(x.bfloat16())
    assert out.dtype == torch.bfloat16
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_forward_backward_has_no_host_sync():
    torch.manual_seed(0)
    layer = build(256, num_experts=16, top_k=4, expert_hidden=128).cuda().to(torch.bfloat16).train()
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().square().mean().backward()  # warm-up: lazy init may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        (out.float() * torch.randn_like(out, dtype=torch.float32)).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("shared", [0, 1])
def test_a_residual_is_added_as_the_block_adds_it(shared):
    """MoELayer(x, residual) (MOE_RESIDUAL_ADD=combine: folded into the combine where the local
    combine runs) gives residual + MoELayer(x) and the same gradients; on the CPU bit for bit."""
    torch.manual_seed(3)
    layer = build(16, num_experts=6, top_k=2, expert_hidden=8, num_shared_experts=shared).train()
    x = torch.randn(2, 9, 16, requires_grad=True)
    res = torch.randn(2, 9, 16, requires_grad=True)
    probe = torch.randn(2, 9, 16)
    outs, gs = [], []
    for folded in (False, True):
        out = layer(x, residual=res) if folded else res + layer(x)
        (out * probe).sum().backward()
        outs.append(out.detach())
        gs.append([t.grad.clone() for t in (x, res, *layer.parameters())])
        layer.zero_grad()
        x.grad = res.grad = None
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*gs, strict=True):
        assert torch.equal(a, b)
