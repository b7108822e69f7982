"""Fused RMSNorm: on CUDA where x and the weight share a dtype, torch's fused forward with our
Triton backward; our Triton kernels both ways where they do not (fp32 weights under autocast);
the eager reference on CPU. The notes below are about the Triton kernels.

The eager norm is ~7 memory-bound kernels forward (cast, pow, mean, add, rsqrt, mul, cast, mul)
and keeps an fp32 copy of its input plus the normalised bf16 rows for backward. The fused
forward reads x once and writes y and one fp32 rstd per row; it keeps only x (its own input,
alive anyway), rstd and the weight. Backward recomputes the normalised rows from them.

Numerics follow the reference (transformers' OLMoE order): n = (x32 * rstd).to(x.dtype),
y = weight * n, computed as fp32(weight) * fp32(n) rounded once to the promoted dtype.
Backward works in fp32 (the reference rounds dy * weight to the input dtype first; the fused
path does not, so bf16 gradients agree to about one bf16 step).

Deterministic: the weight gradient is a per-program partial sum over a fixed, contiguous
range of rows (the split depends only on the row count), reduced by one ``sum`` over the
programs; no atomics. (``train.deterministic`` checks only the dispatcher, expert-GEMM and
precision-recipe seams; these kernels need no declaration there.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moe.kernels.routing import HAVE_TRITON, use_triton
from moe.switches import choice

# Under torch's fused forward, our backward (_RMSNorm with torch_forward); MOE_NORM_BACKWARD=torch
# keeps torch's own backward (the side-by-side in bench/h200/norm_backward.sh).
TRITON_BACKWARD = choice("MOE_NORM_BACKWARD") == "triton"
# Widest row the one-pass kernels hold in registers; wider rows take the eager path.
MAX_WIDTH = 8192
# Backward: at most this many programs, each over a contiguous range of rows (a fixed split,
# so the weight gradient's summation order depends on the row count only, not the device).
BWD_PROGRAMS = 512
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rmsnorm_fwd(x, w, y, rstd, M, D, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        rmask, cmask = rows < M, cols < D
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(xv * xv, axis=1) / D + eps)
        n = (xv * r[:, None]).to(x.dtype.element_ty).to(tl.float32)
        wv = tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(y + offs, (wv[None, :] * n).to(y.dtype.element_ty), mask=mask)
        tl.store(rstd + rows, r, mask=rmask)

    @triton.jit
    def _rmsnorm_bwd(
        dy,
        x,
        w,
        rstd,
        dx,
        dw,
        res,
        M,
        D,
        rows_per_program,
        HAS_DW: tl.constexpr,
        ROUND_N: tl.constexpr,
        HAS_RES: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < D
        wv = tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        start = pid * rows_per_program
        end = tl.minimum(start + rows_per_program, M)
        for first in range(start, end, ROWS):  # ROWS rows at a time, in order
            rows = first + tl.arange(0, ROWS)
            rmask = rows < end
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
            xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(rstd + rows, mask=rmask, other=0.0)
            nh = xv * r[:, None]
            if HAS_DW:
                if ROUND_N:  # OLMoE's order: the normalised rows rounded before the weight
                    acc += tl.sum(g * nh.to(x.dtype.element_ty).to(tl.float32), axis=0)
                else:  # torch's fused forward: one rounding of x * rstd * w
                    acc += tl.sum(g * nh, axis=0)
            dn = g * wv[None, :]
            c = tl.sum(dn * nh, axis=1) / D
            grad_x = r[:, None] * (dn - nh * c[:, None])
            if HAS_RES:  # the gradient x also gets through the residual stream, added here
                grad_x += tl.load(res + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx + offs, grad_x.to(dx.dtype.element_ty), mask=mask)
        if HAS_DW:
            tl.store(dw + pid.to(tl.int64) * D + cols, acc, mask=cmask)


def _rows(block: int) -> int:
    """Rows per tile: about 4096 elements (one row from 4096 wide, up to 16 narrow rows)."""
    return max(1, min(16, 4096 // block))


def _warps(elements: int) -> int:
    return min(32, max(4, elements // 256))


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows: int | None = None, warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) for 2-D contiguous x [M, D]: y in the promoted dtype, rstd fp32 [M].
    ``rows`` per program and ``warps``: the launch (default: ``_rows``/``_warps``; bench.norm_tiles)."""
    m, d = x.shape
    y = torch.empty(m, d, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(d)
        rows = rows or _rows(block)
        warps = warps or _warps(rows * block)
        _rmsnorm_fwd[(triton.cdiv(m, rows),)](x, weight, y, rstd, m, d, eps, ROWS=rows, BLOCK=block, num_warps=warps)
    return y, rstd


def rms_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_dw: bool = True,
    programs: int = BWD_PROGRAMS,
    rows: int | None = None,
    warps: int | None = None,
    stages: int | None = None,
    round_normalised: bool = True,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype, dweight in weight's dtype or None) for 2-D contiguous grad and x;
    ``residual`` (x's shape): a gradient x gets through another use, added to dx in the pass.
    ``programs``, ``rows`` per iteration, ``warps``, ``stages``: the launch (bench.norm_tiles).
    ``round_normalised``: the forward rounded the normalised rows before the weight (ours, OLMoE's
    order), else it rounded once (torch's fused forward)."""
    m, d = x.shape
    dx = torch.empty_like(x)
    if m == 0:
        return dx, torch.zeros_like(weight) if need_dw else None
    per = triton.cdiv(m, min(m, programs))
    n_prog = triton.cdiv(m, per)
    partial = torch.empty(n_prog, d, dtype=torch.float32, device=x.device) if need_dw else rstd
    block = triton.next_power_of_2(d)
    rows = rows or _rows(block)
    launch = {"num_warps": warps or _warps(rows * block), **({"num_stages": stages} if stages else {})}
    res = residual.contiguous() if residual is not None else x
    _rmsnorm_bwd[(n_prog,)](
        grad,
        x,
        weight,
        rstd,
        dx,
        partial,
        res,
        m,
        d,
        per,
        HAS_DW=need_dw,
        ROUND_N=round_normalised,
        HAS_RES=residual is not None,
        ROWS=rows,
        BLOCK=block,
        **launch,
    )
    return dx, partial.sum(0).to(weight.dtype) if need_dw else None


# The backward's launch under torch's forward: the fastest of 72 at [16384, 2048] bf16 on an H200
# (bench.norm_tiles, norm_tiles-NVIDIA-H200-20261204T145012Z.json: 94.6 us against torch's 133.1).
TORCH_FORWARD_BACKWARD_LAUNCH = {"programs": 1056, "rows": 4, "warps": 8, "stages": 3}


def _forward_rows(x2: torch.Tensor, weight: torch.Tensor, eps: float, torch_forward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd [M]) of 2-D x: torch's fused forward (one rounding) or ours (OLMoE's order)."""
    if torch_forward:
        y, rstd = torch.ops.aten._fused_rms_norm(x2, [x2.shape[-1]], weight, eps)
        return y, rstd.reshape(-1)
    return rms_norm_forward(x2, weight, eps)


def _backward_launch(torch_forward: bool) -> dict:
    """The backward's keywords for the forward that ran (its rounding, and the launch chosen for it)."""
    return {"round_normalised": False, **TORCH_FORWARD_BACKWARD_LAUNCH} if torch_forward else {}


class _RMSNorm(torch.autograd.Function):
    """Our Triton backward under our Triton forward (OLMoE's rounding order), or, with
    ``torch_forward``, under torch's fused forward (``aten._fused_rms_norm``: 51 us at [16384,
    2048], ahead of our 57; our backward 95 us against torch's 133): either way the backward
    reads x and dy once and writes dx, with the weight gradient's partial sums in the same pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, torch_forward: bool = False) -> torch.Tensor:
        x2, weight = x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous()
        y, rstd = _forward_rows(x2, weight, eps, torch_forward)
        ctx.save_for_backward(x2, weight, rstd)  # x is the caller's tensor: no new activation but rstd
        ctx.shape, ctx.torch_forward = x.shape, torch_forward
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        grad = grad.reshape(x2.shape).contiguous()
        dx, dw = rms_norm_backward(grad, x2, weight, rstd, need_dw=ctx.needs_input_grad[1], **_backward_launch(ctx.torch_forward))
        return dx.view(ctx.shape), dw, None, None


class _ResidualRMSNorm(torch.autograd.Function):
    """(x, norm(x)) for a norm whose input also goes on in the residual stream (a pre-norm
    block's ``x + f(norm(x))``): x comes back as an output of this Function, so its backward gets
    both gradients, the residual's and the norm's, and adds them in the norm's backward pass
    (autograd would otherwise sum the two uses of x in an add kernel of its own: read two, write
    one, per norm). Forward: torch's fused norm, as :func:`rms_norm`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x2, weight = x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous()
        y, rstd = _forward_rows(x2, weight, eps, x2.is_cuda)  # our forward under the interpreter (tests)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return x.view_as(x), y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_residual: torch.Tensor | None, grad: torch.Tensor | None):
        x2, weight, rstd = ctx.saved_tensors
        if grad is None:  # the normalised rows were not used
            return grad_residual, None, None
        grad = grad.reshape(x2.shape).contiguous()
        residual = grad_residual.reshape(x2.shape) if grad_residual is not None else None
        launch = _backward_launch(x2.is_cuda)
        dx, dw = rms_norm_backward(grad, x2, weight, rstd, need_dw=ctx.needs_input_grad[1], residual=residual, **launch)
        return dx.view(ctx.shape), dw, None


# The residual's gradient added in the norm's backward pass (measured: 0.5-0.6% off the OLMoE-width step on
# the H200, 0.8-1.0% on an H100; bench/NOTES.md); MOE_RESIDUAL_NORM=0 keeps autograd's separate add.
RESIDUAL_IN_BACKWARD = choice("MOE_RESIDUAL_NORM") == "1"


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, rms_norm(x)) for a caller that adds into x's residual stream: use the first output
    as the residual. On CUDA with x and weight of one dtype (where :func:`rms_norm` runs our
    backward), one backward pass adds the residual's gradient to the norm's; elsewhere x itself
    and :func:`rms_norm`."""
    if RESIDUAL_IN_BACKWARD and TRITON_BACKWARD and x.dtype == weight.dtype and fusable(x, weight):
        return _ResidualRMSNorm.apply(x, weight, eps)
    return x, rms_norm(x, weight, eps)


def fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton path applies (CUDA with Triton, or the interpreter; rows up to MAX_WIDTH)."""
    return (
        use_triton(x)
        and x.dim() >= 1
        and x.shape[-1] > 0
        and weight.dim() == 1
        and x.shape[-1] == weight.shape[0] <= MAX_WIDTH
        and x.dtype in _DTYPES
        and weight.dtype in _DTYPES
        and weight.device == x.device
    )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager norm (the CPU path and the reference): fp32 statistics, scaled after the cast back."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernels (callers check ``fusable``)."""
    return _RMSNorm.apply(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMS-normalised x over the last dimension.

    On CUDA with x and weight of one dtype (the bf16 recipes): torch's fused forward
    (``aten._fused_rms_norm``, faster than our Triton forward) with our Triton backward at the
    launch bench.norm_tiles chose (95 against torch's 133 us at [16384, 2048] on an H200), keeping
    the same bytes; it rounds once (bf16(x * rstd * w)) where OLMoE rounds the normalised rows
    first, about one bf16 step apart. Mixed dtypes (fp32 weights under autocast) take our kernels, which keep
    OLMoE's order; CPU takes the eager reference."""
    if x.is_cuda and x.dtype == weight.dtype and x.dtype in _DTYPES and x.shape[-1] > 0:
        if TRITON_BACKWARD and fusable(x, weight):
            return _RMSNorm.apply(x, weight, eps, True)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if fusable(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
