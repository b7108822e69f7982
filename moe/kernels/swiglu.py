"""Fused SwiGLU on the stacked gate/up projection: a = silu(h[:, :H]) * h[:, H:].

One read of h and one write of a forward; backward reads h and the incoming gradient once and
writes the [N, 2H] gradient, instead of torch's separate silu, mul and their backwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.kernels.routing import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_fwd(h, out, n, H, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row, col = offs // H, offs % H
        g = tl.load(h + row * 2 * H + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h + row * 2 * H + H + col, mask=mask, other=0.0).to(tl.float32)
        s = g * tl.sigmoid(g)
        tl.store(out + offs, (s * u).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(h, grad, grad_h, n, H, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row, col = offs // H, offs % H
        g = tl.load(h + row * 2 * H + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h + row * 2 * H + H + col, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        s = g * sig
        dg = d * u * (sig + s * (1.0 - sig))
        tl.store(grad_h + row * 2 * H + col, dg.to(grad_h.dtype.element_ty), mask=mask)
        tl.store(grad_h + row * 2 * H + H + col, (d * s).to(grad_h.dtype.element_ty), mask=mask)


BLOCK = 1024


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        ctx.save_for_backward(h)
        rows, hidden = h.shape[0], h.shape[1] // 2
        out = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)
        n = rows * hidden
        if n:
            _swiglu_fwd[(triton.cdiv(n, BLOCK),)](h, out, n, hidden, BLOCK=BLOCK)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (h,) = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h = torch.empty_like(h)
        n = grad.numel()
        if n:
            _swiglu_bwd[(triton.cdiv(n, BLOCK),)](h, grad, grad_h, n, h.shape[1] // 2, BLOCK=BLOCK)
        return grad_h


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] along the last dimension."""
    if use_triton(h):
        return _SwiGLU.apply(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
