"""The fused expert MLP (gather prologue, SwiGLU / dSwiGLU epilogues, persistent grouped GEMMs,
gathered wgrad) against a per-expert loop in float64, forward and every gradient, with empty
groups, ragged group sizes and dimensions that are not multiples of a tile.

    TRITON_INTERPRET=1 python tests/kernels/expert_mlp_check.py   # CI: Triton's interpreter on CPU
    python tests/kernels/expert_mlp_check.py --device cuda        # the compiled kernels on a GPU (bf16)
"""

import dataclasses
import os
import sys

CUDA = sys.argv[1:] == ["--device", "cuda"]
assert sys.argv[1:] in ([], ["--device", "cuda"]), "usage: expert_mlp_check.py [--device cuda]"
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1, or with --device cuda"
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe.layers.gemm_fused import FusedExpertMLP  # noqa: E402


def reference(x, order, k, counts, gate_up, down):
    """Per-expert loop in float64: y rows in expert order."""
    rows = x.double().index_select(0, order // k)
    out, start = [], 0
    for e, c in enumerate(counts):
        r = rows[start : start + c]
        h = r @ gate_up[e].double().t()
        gate, up = h.chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ down[e].double().t())
        start += c
    return torch.cat(out)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_case(tokens, k, d, hidden, counts_hint, dtype, tol, gather=True, weight_dtype=None, weights_grad=True):
    """weight_dtype: the routing weights' dtype (the router's are fp32 with bf16 activations);
    weights_grad=False: routing weights that need no gradient (a frozen router)."""
    e = len(counts_hint)
    # routing with the given expert popularity (zeros give empty groups)
    probs = torch.tensor(counts_hint, dtype=torch.float64)
    experts = torch.stack([torch.multinomial(probs, k, replacement=False) for _ in range(tokens)])
    order = torch.argsort(experts.reshape(-1), stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(experts.reshape(-1), minlength=e)
    ends = counts.cumsum(0).to(torch.int32)
    x = (torch.randn(tokens, d) * 0.5).to(dtype).requires_grad_(True)
    weights = torch.rand(tokens, k).to(weight_dtype or dtype).requires_grad_(weights_grad)
    gate_up = (torch.randn(e, 2 * hidden, d) / d**0.5).to(dtype).requires_grad_(True)
    down = (torch.randn(e, d, hidden) / hidden**0.5).to(dtype).requires_grad_(True)
    mlp = FusedExpertMLP()
    gu_r = gate_up.detach().double().requires_grad_(True)
    dn_r = down.detach().double().requires_grad_(True)
    w_r = weights.detach().double().requires_grad_(True)
    if gather:  # token rows in, the weighted combine out
        out = mlp.expert_mlp(x, gate_up, down, ends, order=order, inverse=inverse, weights=weights)
        xr = x.detach().double().requires_grad_(True)
        y_r = reference(xr, order, k, counts.tolist(), gu_r, dn_r)
        ref = torch.bmm(w_r.unsqueeze(1), y_r.index_select(0, inverse).view(tokens, k, d)).squeeze(1)
        src = x
    else:  # expert-ordered rows in and out
        src = x.detach().index_select(0, order // k).requires_grad_(True)
        out = mlp.expert_mlp(src, gate_up, down, ends)
        xr = src.detach().double().requires_grad_(True)
        ref = reference(xr, torch.arange(src.shape[0]), 1, counts.tolist(), gu_r, dn_r)
    probe = torch.randn_like(ref)
    (out.double() * probe).sum().backward()
    (ref * probe).sum().backward()
    errors = {
        "out": rel(out, ref),
        "dx": rel(src.grad, xr.grad),
        "d_gate_up": rel(gate_up.grad, gu_r.grad),
        "d_down": rel(down.grad, dn_r.grad),
    }
    if gather and weights_grad:
        errors["d_weights"] = rel(weights.grad, w_r.grad)
        assert weights.grad.dtype == weights.dtype
    if not weights_grad:
        assert weights.grad is None
    for name, err in errors.items():
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol} (tokens={tokens} k={k} d={d} h={hidden} E={e} {dtype})"
    # empty experts get exact zero weight gradients
    for g in (counts == 0).nonzero().flatten().tolist():
        assert gate_up.grad[g].abs().max() == 0 and down.grad[g].abs().max() == 0, f"expert {g} has no rows but a gradient"
    return errors


def empty_case(dtype) -> None:
    """No tokens at all: empty outputs, zero weight gradients."""
    mlp = FusedExpertMLP()
    x = torch.randn(0, 32).to(dtype).requires_grad_(True)
    gate_up = torch.randn(3, 32, 32).to(dtype).requires_grad_(True)
    down = torch.randn(3, 32, 16).to(dtype).requires_grad_(True)
    empty = torch.zeros(0, dtype=torch.int64)
    weights = torch.zeros(0, 2, requires_grad=True)
    out = mlp.expert_mlp(x, gate_up, down, torch.zeros(3, dtype=torch.int32), order=empty, inverse=empty, weights=weights)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert gate_up.grad.abs().max() == 0 and down.grad.abs().max() == 0 and x.grad.shape == (0, 32)
    assert weights.grad.shape == (0, 2)


def recompute_case(dtype=torch.float32, tol=1e-6) -> None:
    """Selective recompute keeps the fused forward GEMMs (torch ops in its saved set): the up
    projection runs once per forward + backward under ``selective``, twice under ``full``, and
    the gradients are the same in every mode."""
    from torch import nn

    from moe.config import MoEConfig
    from moe.layers import MoELayer, gemm_fused
    from moe.parallel.recompute import _checkpointed_forward

    torch.manual_seed(5)
    block = nn.Module()
    block.moe = MoELayer(48, MoEConfig(num_experts=4, top_k=2, expert_hidden=32, gemm="fused"))
    block.moe.reset_parameters(0.05)
    block.moe.to(dtype)
    x = torch.randn(2, 7, 48).to(dtype)
    calls = []
    original = gemm_fused.grouped_gemm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("swiglu_epilogue", False))
        return original(*args, **kwargs)

    gemm_fused.grouped_gemm = counting
    grads = {}
    try:
        for mode in ("none", "selective", "full"):
            calls.clear()
            block.moe.zero_grad()
            xi = x.clone().requires_grad_(True)
            out = block.moe(xi) if mode == "none" else _checkpointed_forward(block, block.moe, mode, xi)
            out.square().sum().backward()
            grads[mode] = (xi.grad, [p.grad.clone() for p in block.moe.parameters()])
            ups = sum(calls)
            assert ups == (2 if mode == "full" else 1), (mode, ups)
    finally:
        gemm_fused.grouped_gemm = original
    for mode in ("selective", "full"):
        assert rel(grads[mode][0], grads["none"][0]) < tol, mode
        for a, b in zip(grads[mode][1], grads["none"][1], strict=True):
            assert rel(a, b) < tol, mode


def layer_case(dtype=torch.float32, tol=1e-5) -> None:
    """The MoE layer with ``gemm: fused`` (token rows read through the routing indices) against the
    same layer on torch's grouped GEMM: output and every parameter's gradient."""
    from moe.config import MoEConfig
    from moe.layers import MoELayer

    cfg = MoEConfig(num_experts=6, top_k=2, expert_hidden=40)
    layers = {}
    for gemm in ("grouped_mm", "fused"):
        torch.manual_seed(3)
        layer = MoELayer(56, dataclasses.replace(cfg, gemm=gemm))
        layer.reset_parameters(0.05)
        layers[gemm] = layer.to(dtype)
    assert layers["fused"].experts.reads_token_rows and not layers["grouped_mm"].experts.reads_token_rows
    x = torch.randn(3, 11, 56).to(dtype)
    probe = torch.randn(3, 11, 56).to(dtype)
    outs = {}
    for gemm, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out * probe).sum().backward()
        outs[gemm] = (out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()})
    ref, got = outs["grouped_mm"], outs["fused"]
    assert rel(got[0], ref[0]) < tol, rel(got[0], ref[0])
    assert rel(got[1], ref[1]) < tol, rel(got[1], ref[1])
    for name, grad in ref[2].items():
        assert rel(got[2][name], grad) < tol, (name, rel(got[2][name], grad))


def main() -> int:
    torch.manual_seed(0)
    if CUDA:  # the compiled kernels (fp32 on CUDA takes torch's path, so bf16 throughout)
        torch.set_default_device("cuda")
        dtype, tol = torch.bfloat16, 2e-2
    else:  # fp32 under the interpreter (ieee dot): tight
        dtype, tol = torch.float32, 1e-5
    # ragged groups, empty experts, dims off the tile grid
    run_case(37, 2, 72, 40, [3, 0, 1, 5, 0, 2], dtype, tol)
    run_case(150, 3, 136, 136, [1, 2, 3, 4, 5, 6, 7, 0], dtype, tol)  # > one 128-row tile per expert
    run_case(20, 1, 64, 32, [1, 0, 0], dtype, tol)  # all rows in one expert, the rest empty
    run_case(29, 2, 48, 24, [1, 1, 1, 1], dtype, tol, gather=False)  # rows already in expert order
    run_case(17, 1, 40, 24, [0, 0, 1, 3], dtype, tol)  # empty experts first
    run_case(9, 1, 32, 16, [1], dtype, tol)  # one expert
    if CUDA:
        run_case(4096, 8, 512, 256, [1] * 64, dtype, tol)  # many tiles per program on a real grid
    empty_case(dtype)
    run_case(30, 2, 48, 32, [1, 2, 0, 1], dtype, tol, weights_grad=False)  # a router that needs no gradient
    # bf16 in and out, fp32 accumulation: bf16 rounding of h, a and the outputs only; routing
    # weights fp32 as the router makes them
    errs = run_case(64, 2, 64, 64, [1, 1, 2, 0], torch.bfloat16, 2e-2, weight_dtype=torch.float32)
    # determinism: the same inputs give the same bits
    torch.manual_seed(1)
    a = run_case(40, 2, 32, 32, [1, 2, 0, 1], dtype, tol)
    torch.manual_seed(1)
    b = run_case(40, 2, 32, 32, [1, 2, 0, 1], dtype, tol)
    assert a == b, (a, b)
    layer_case(dtype, 2e-2 if CUDA else 1e-5)
    recompute_case(dtype, 1e-2 if CUDA else 1e-6)
    if CUDA:  # the FP8 token-row path with the compiled quantisation, gather and combine kernels
        # (GEMMs emulated); under the interpreter its kernels are checked by fp8_check.py and the
        # path itself by tests/layers/test_gemm_fp8.py on torch's path (CI time)
        from tests.layers.test_gemm_fp8 import test_fp8_experts_on_token_rows_match_the_gathered_path as fp8_token_rows

        fp8_token_rows(0)
        fp8_token_rows(10**6)
    print("bf16 errors", {k: f"{v:.2e}" for k, v in errs.items()})
    print("expert mlp kernels ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
