"""Run under TRITON_INTERPRET=1: the fused RMSNorm kernels against the eager reference.

fp32: y, dx and dweight within 1e-5 of the eager norm (relative to the largest magnitude, or
absolute below 1).
bf16: the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so
each of y, dx and dweight is compared with an fp64 computation on the same bf16 inputs and
must be within two bf16 steps (2^-6, relative to the largest magnitude), as must the eager
norm; the GPU's agreement is reported by ``python -m bench.norm``.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
import torch  # noqa: E402

from moe.kernels import rmsnorm  # noqa: E402
from moe.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402

EPS = 1e-5
BF16_TOL = 2.0**-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def run(fn, x, w, g):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = fn(x, w, EPS)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def fp64(x, w, g):
    x, w = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
    y.backward(g.double())
    return y.detach(), x.grad, w.grad


def inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    g = torch.randn(*shape, generator=gen).to(dtype)
    return x, w, g


# rows x width: a width that is not a power of two, row counts that are not a multiple of the
# forward's rows per program (16 at these widths), one row, and the widest row taken (8192)
SHAPES = [(7, 40), (33, 1100), (1, 1), (50, 96), (2, 5, 40), (3, 8192)]


def check_fp32() -> None:
    for shape in SHAPES:
        x, w, g = inputs(shape, torch.float32)
        assert rmsnorm.fusable(x, w), shape
        got, ref = run(rms_norm, x, w, g), run(rms_norm_reference, x, w, g)
        for name, a, b in zip(("y", "dx", "dweight"), got, ref, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (shape, name)
            assert rel(a, b) <= 1e-5, f"fp32 {shape} {name}: {rel(a, b)}"


def check_bf16() -> None:
    for shape in [(33, 1100), (2, 5, 40), (64, 2048), (3, 8192)]:
        x, w, g = inputs(shape, torch.bfloat16)
        truth = fp64(x, w, g)
        got, ref = run(rms_norm, x, w, g), run(rms_norm_reference, x, w, g)
        for name, a, b, t in zip(("y", "dx", "dweight"), got, ref, truth, strict=True):
            assert a.dtype == torch.bfloat16, (shape, name)
            assert rel(a, t) <= BF16_TOL, f"bf16 {shape} {name}: fused {rel(a, t)} from fp64"
            assert rel(b, t) <= BF16_TOL, f"bf16 {shape} {name}: eager {rel(b, t)} from fp64"
            assert rel(a, b) <= BF16_TOL, f"bf16 {shape} {name}: fused {rel(a, b)} from eager"


def check_mixed_dtypes() -> None:
    """bf16 input with an fp32 weight promotes as the eager product does (fp32 output)."""
    x, _, _ = inputs((9, 72), torch.bfloat16)
    w = 1 + 0.2 * torch.randn(72)
    g = torch.randn(9, 72)
    got, ref = run(rms_norm, x, w, g), run(rms_norm_reference, x, w, g)
    assert got[0].dtype == ref[0].dtype == torch.float32
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for name, a, b in zip(("y", "dx", "dweight"), got, ref, strict=True):
        assert rel(a, b) <= BF16_TOL, f"mixed {name}: {rel(a, b)}"


def check_weight_gradient_split() -> None:
    """Rows split over few programs (a remainder in the last) give the same dweight as one row each."""
    x, w, g = inputs((33, 100), torch.float32, seed=1)
    y, rstd = rmsnorm.rms_norm_forward(x, w, EPS)
    dx1, dw1 = rmsnorm.rms_norm_backward(g, x, w, rstd, programs=4)  # 9 rows per program, 6 in the last
    dx2, dw2 = rmsnorm.rms_norm_backward(g, x, w, rstd, programs=512)
    dx3, dw3 = rmsnorm.rms_norm_backward(g, x, w, rstd, programs=2)  # 17 rows: a 16-row tile and one row
    _, ref_dx, ref_dw = run(rms_norm_reference, x, w, g)
    assert torch.equal(dx1, dx2) and torch.equal(dx1, dx3)
    for dw in (dw1, dw2, dw3):
        assert rel(dw, ref_dw) <= 1e-5
    assert rel(dx1, ref_dx) <= 1e-5
    _, none = rmsnorm.rms_norm_backward(g, x, w, rstd, need_dw=False)
    assert none is None


def check_deterministic() -> None:
    """Two runs, bitwise equal (the weight gradient reduces per-program partials in a fixed order)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w, g = inputs((1030, 48), dtype, seed=2)  # > 512 rows: several rows per backward program
        a, b = run(rms_norm, x, w, g), run(rms_norm, x, w, g)
        for name, u, v in zip(("y", "dx", "dweight"), a, b, strict=True):
            assert torch.equal(u, v), f"{dtype} {name} differs between runs"


def check_fallback() -> None:
    """Wider rows than the kernels hold, or a float64 input, take the eager path (bitwise)."""
    for x, w in [(torch.randn(2, 8193), torch.randn(8193)), (torch.randn(3, 8, dtype=torch.float64), torch.randn(8))]:
        assert not rmsnorm.fusable(x, w)
        assert torch.equal(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    empty = torch.randn(0, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = rms_norm(empty, w, EPS)
    y.sum().backward()
    assert y.shape == (0, 16) and empty.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16))


def check_module() -> None:
    from moe.nn import RMSNorm

    norm = RMSNorm(40, eps=1e-6)
    assert list(norm.state_dict()) == ["weight"]
    with torch.no_grad():
        norm.weight.mul_(torch.linspace(0.5, 1.5, 40))
    x = torch.randn(2, 3, 40)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-6)


def check_recompute() -> None:
    """A model's gradients are bitwise equal with and without recompute, and the selective modes
    recompute the fused norms (their forward runs again in backward) rather than keep them."""
    from moe.config import ModelConfig
    from moe.model import Transformer
    from moe.parallel.recompute import RECOMPUTE_MODES, apply_recompute

    launches = [0]
    forward = rmsnorm.rms_norm_forward

    def counting(*args, **kwargs):
        launches[0] += 1
        return forward(*args, **kwargs)

    rmsnorm.rms_norm_forward = counting
    try:
        tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
        ref = None
        for mode in RECOMPUTE_MODES:
            torch.manual_seed(0)
            model = Transformer(ModelConfig.from_dict({"preset": "tiny"}).validate())
            apply_recompute(model, mode)
            launches[0] = 0
            model(tokens).float().square().mean().backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            norms = 2 * (2 + 2) + 1  # per block attn, q, k, mlp; the final norm
            recomputed = 0 if mode == "none" else 2 * 4
            assert launches[0] == norms + recomputed, f"{mode}: {launches[0]} norm forwards"
            if ref is None:
                ref = grads
            for n, gr in ref.items():
                assert torch.equal(grads[n], gr), f"{mode}: gradient of {n} differs from no recompute"
    finally:
        rmsnorm.rms_norm_forward = forward


def check_torch_forward_triton_backward():
    """torch's fused forward with our backward (the CUDA bf16 path): y is torch's bitwise, and
    dx and dweight agree with autograd through torch's norm in float64 (one rounding, no
    rounding of the normalised rows), for every launch shape the benchmark sweeps."""
    for shape in ((37, 96), (300, 2048)):
        x = (torch.randn(*shape) * 2).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(shape[-1])).to(torch.bfloat16)
        dy = torch.randn(*shape).to(torch.bfloat16)
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = rmsnorm._RMSNorm.apply(xr, wr, 1e-5, True)
        assert torch.equal(y, torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-5))
        y.backward(dy)
        x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
        torch.nn.functional.rms_norm(x64, (shape[-1],), w64, 1e-5).backward(dy.double())
        torch.testing.assert_close(xr.grad.double(), x64.grad, rtol=2.0**-7, atol=2.0**-7 * x64.grad.abs().max().item())
        torch.testing.assert_close(wr.grad.double(), w64.grad, rtol=2.0**-7, atol=2.0**-7 * w64.grad.abs().max().item())


def check_residual() -> None:
    """rms_norm_with_residual: (x, the norm) whose backward adds the residual stream's gradient
    to the norm's in one pass; both gradients against the eager norm plus autograd's sum, and
    with only one of the two outputs used (the default path; MOE_RESIDUAL_NORM=0 turns it off)."""
    rmsnorm.RESIDUAL_IN_BACKWARD = True
    for shape in ((7, 40), (2, 5, 96)):
        x, w, g = inputs(shape, torch.float32, seed=5)
        f = torch.randn(shape[-1], shape[-1], generator=torch.Generator().manual_seed(6)) / shape[-1] ** 0.5
        grads = []
        for fn in (rmsnorm.rms_norm_with_residual, lambda x, w, eps: (x, rms_norm_reference(x, w, eps))):
            xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            h, y = fn(xr, wr, EPS)
            assert torch.equal(h, x)
            ((h + y @ f) * g).sum().backward()
            grads.append((y.detach(), xr.grad, wr.grad))
        for got, ref, name in zip(grads[0], grads[1], ("y", "dx", "dweight"), strict=True):
            assert rel(got, ref) < 1e-5, (shape, name, rel(got, ref))
        xr = x.clone().requires_grad_(True)
        h, _ = rmsnorm.rms_norm_with_residual(xr, w, EPS)
        (h * g).sum().backward()
        assert torch.equal(xr.grad, g), "only the residual used: its gradient passes unchanged"
        _, ref_dx, _ = run(rms_norm_reference, x, w, g)
        xr = x.clone().requires_grad_(True)
        _, y = rmsnorm.rms_norm_with_residual(xr, w, EPS)
        y.backward(g)
        assert rel(xr.grad, ref_dx) < 1e-5, "only the norm used"
    x, w, _ = inputs((3, 40), torch.float32)
    h, _ = rmsnorm.rms_norm_with_residual(x.requires_grad_(True), w, EPS)
    assert "ResidualRMSNorm" in type(h.grad_fn).__name__, "the fused path ran"


def main() -> int:
    torch.manual_seed(0)
    check_fp32()
    check_bf16()
    check_mixed_dtypes()
    check_weight_gradient_split()
    check_deterministic()
    check_fallback()
    check_module()
    check_recompute()
    check_torch_forward_triton_backward()
    check_residual()
    print("rmsnorm kernels ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
