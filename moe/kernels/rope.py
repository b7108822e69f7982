"""Fused rotary embedding (Triton on CUDA, the eager rotate-half reference elsewhere).

Eager RoPE is five memory-bound kernels per tensor forward (negate, cat, two muls, add) and as
many backward, each over the whole [batch, heads, seq, head_dim] tensor. The fused kernel reads
each head vector once and writes it once, forward and backward (backward is the same rotation
by the negated angle), and keeps nothing for backward: the cos/sin tables are the module's
buffers. It works on the projection's own [batch, seq, heads, head_dim] layout, so no copy is
made for the transpose SDPA wants.

Numerics: the rotation is computed in fp32 from the fp32 tables and rounded once to the input
dtype; eager bf16 rounds cos/sin, both products and the sum (transformers' order), so the two
agree to about one bf16 step.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moe.kernels.routing import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(x, y, cos, sin, R, S, H, table_stride, SIGN: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        rmask, cmask = rows < R, cols < HALF
        mask = rmask[:, None] & cmask[None, :]
        pos = (rows // H) % S
        base = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
        t = pos.to(tl.int64)[:, None] * table_stride + cols[None, :]
        c = tl.load(cos + t, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin + t, mask=mask, other=0.0).to(tl.float32) * SIGN
        x1 = tl.load(x + base, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + base + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(y + base, (x1 * c - x2 * s).to(y.dtype.element_ty), mask=mask)
        tl.store(y + base + HALF, (x2 * c + x1 * s).to(y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x: contiguous [batch, seq, heads, head_dim]; cos/sin: fp32 [>= seq, head_dim]."""
    b, s, h, d = x.shape
    y = torch.empty_like(x)
    rows_total = b * s * h
    if rows_total:
        half = d // 2
        block = triton.next_power_of_2(half)
        rows = max(1, min(64, 4096 // block))
        _rope_kernel[(triton.cdiv(rows_total, rows),)](
            x, y, cos, sin, rows_total, s, h, cos.stride(0), SIGN=sign, HALF=half, ROWS=rows, BLOCK=block, num_warps=4
        )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)  # the module's buffers: nothing new is kept
        return _launch(x.contiguous(), cos, sin, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _launch(grad.contiguous(), cos, sin, -1.0), None, None


def fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None = None) -> bool:
    """Whether the kernel applies: CUDA (or the interpreter), [b, h, s, d] with d even, and
    rotate-half tables (cos[:, :d/2] == cos[:, d/2:]) covering the sequence; sin laid out as cos."""
    sin = cos if sin is None else sin
    return (
        use_triton(x)
        and x.dim() == 4
        and x.shape[-1] % 2 == 0
        and x.shape[-1] > 0
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and cos.is_floating_point()
        and cos.dim() == 2
        and cos.shape[-1] == x.shape[-1]
        and cos.shape[0] >= x.shape[-2]
        and cos.device == x.device
        and cos.stride(-1) == 1
        and sin.shape == cos.shape
        and sin.stride() == cos.stride()
        and sin.dtype == cos.dtype
        and sin.device == cos.device
    )


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eager rotate-half RoPE on [batch, heads, seq, head_dim] (tables already in x's dtype)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the tables cos/sin [>= seq, head_dim]."""
    seq = x.shape[-2]
    if fusable(x, cos, sin):
        # the kernel runs on [batch, seq, heads, head_dim]: the projection's layout, usually
        # what x is a transposed view of (then no copy is made)
        return _Rope.apply(x.transpose(1, 2), cos, sin).transpose(1, 2)
    return rope_reference(x, cos[:seq].to(x.dtype), sin[:seq].to(x.dtype))
