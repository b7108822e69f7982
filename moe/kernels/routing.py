"""Fused token permutation kernels (Triton on CUDA; the torch path elsewhere).

Token slots are sorted by expert; ``order`` lists the sorted slots and ``inverse`` the sorted
row of each (token, k) slot. Two autograd functions replace generic index ops:

- ``gather_rows(x, order, k)``: the expert-ordered copy of the tokens. Backward sums the k
  gradient rows of every token by gathering them (no atomics, deterministic).
- ``combine(y, inverse, weights, residual=None)``: out[t] = (residual[t] +) sum_j weights[t, j] *
  y[inverse[t*k + j]] in one pass (fp32 accumulation, one rounding). Backward writes each
  y-gradient row once and the k weight gradients (dot products) in the same pass; the residual's
  gradient is the output's.

Both are exact rearrangements of the torch reference (index_select, bmm), to rounding.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    HAVE_TRITON = False


def use_triton(t: torch.Tensor) -> bool:
    if not HAVE_TRITON:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return t.is_cuda


if HAVE_TRITON:

    @triton.jit
    def source_rows(row_index, rows, mask, GATHER: tl.constexpr):
        """The rows a kernel reads: row_index[rows] (a gather folded into its loads) or the rows."""
        if GATHER:
            return tl.load(row_index + rows, mask=mask, other=0).to(tl.int64)
        return rows.to(tl.int64)

    @triton.jit
    def _gather_reduce_kernel(src, idx, w, res, out, D, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr = False):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        # the residual stream's add folded in: one read here instead of an add kernel's three passes
        if HAS_RES:  # noqa: SIM108 (a constexpr branch)
            acc = tl.load(res + t.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(idx + t * K + j).to(tl.int64)
            v = tl.load(src + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w + t * K + j).to(tl.float32)
            acc += v
        tl.store(out + t.to(tl.int64) * D + cols, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_backward_kernel(grad_out, y, idx, w, grad_y, grad_w, D, K: tl.constexpr, BLOCK: tl.constexpr, WRITE_GRAD_Y: tl.constexpr = True):
        slot = tl.program_id(0)
        t = (slot // K).to(tl.int64)
        row = tl.load(idx + slot).to(tl.int64)
        if WRITE_GRAD_Y:
            weight = tl.load(w + slot).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, D, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < D
            g = tl.load(grad_out + t * D + cols, mask=mask, other=0.0).to(tl.float32)
            yv = tl.load(y + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            if WRITE_GRAD_Y:
                tl.store(grad_y + row * D + cols, (g * weight).to(grad_y.dtype.element_ty), mask=mask)
            dot += g * yv
        tl.store(grad_w + slot, tl.sum(dot, axis=0))


def _block(d: int) -> int:
    return min(1024, triton.next_power_of_2(d))


def gather_reduce(src: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None, k: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = (residual[t] +) sum_j (weights[t, j] *) src[idx[t*k + j]]  -> [len(idx) // k, D],
    src's dtype. With a residual the Triton path rounds once (the sum in fp32), the torch path
    rounds the combine and then the add."""
    n_tokens, d = idx.numel() // k, src.shape[1]
    if not use_triton(src):
        rows = src.index_select(0, idx).view(n_tokens, k, d)
        out = rows.sum(1) if weights is None else torch.bmm(weights.to(src.dtype).unsqueeze(1), rows).squeeze(1)
        return out if residual is None else residual + out
    src, idx = src.contiguous(), idx.contiguous()
    out = torch.empty(n_tokens, d, dtype=src.dtype, device=src.device)
    if n_tokens == 0:
        return out
    block = _block(d)
    w = weights.contiguous().float() if weights is not None else src
    res = residual.contiguous() if residual is not None else src
    _gather_reduce_kernel[(n_tokens, triton.cdiv(d, block))](
        src, idx, w, res, out, d, K=k, HAS_W=weights is not None, BLOCK=block, HAS_RES=residual is not None
    )
    return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, row_index: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, row_index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return gather_reduce(grad.contiguous(), inverse, None, ctx.k), None, None, None


def gather_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of x in expert order (slot order[i] = token order[i] // k)."""
    return _GatherRows.apply(x, order // k, inverse, k)


def gather_token_rows(x: torch.Tensor, row_index: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """x[row_index] with the deterministic backward of :func:`gather_rows` (row_index = order // k);
    the torch path (index_select) where Triton does not run."""
    if not use_triton(x):
        return x.index_select(0, row_index)
    return _GatherRows.apply(x, row_index, inverse, k)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(y, inverse, weights)
        ctx.has_residual = residual is not None
        return gather_reduce(y, inverse, weights, weights.shape[1], residual)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, inverse, weights = ctx.saved_tensors
        n_tokens, k = weights.shape
        grad = grad.contiguous()
        if not use_triton(y):
            rows = y.index_select(0, inverse).view(n_tokens, k, -1)
            grad_w = torch.bmm(rows.float(), grad.float().unsqueeze(2)).squeeze(2)
            grad_rows = (weights.to(grad.dtype).unsqueeze(2) * grad.unsqueeze(1)).reshape(n_tokens * k, -1)
            grad_y = torch.empty_like(y).index_copy_(0, inverse, grad_rows)
        else:
            grad_y, grad_w = combine_backward(grad, y, inverse, weights)
        return grad_y, None, grad_w.to(weights.dtype), grad if ctx.has_residual else None


def combine(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = (residual[t] +) sum_j weights[t, j] * y[inverse[t*k + j]] (see the module's docstring)."""
    if residual is None:
        return _Combine.apply(y, inverse, weights)
    return _Combine.apply(y, inverse, weights, residual)


def combine_backward(grad_out: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of the weighted combine in one pass over grad_out: the rows
    grad_y[inverse[t*k + j]] = weights[t, j] * grad_out[t] (multiplied in fp32, y's dtype) and the
    weights' gradient grad_out[t] . y[inverse[t*k + j]] (fp32, [T, k])."""
    n_tokens, k = weights.shape
    grad_out = grad_out.contiguous()
    if not use_triton(y):
        rows = (weights.float().unsqueeze(2) * grad_out.float().unsqueeze(1)).reshape(n_tokens * k, -1).to(y.dtype)
        return torch.empty_like(y).index_copy_(0, inverse, rows), combine_weight_grad(grad_out, y, inverse, k)
    grad_y = torch.empty_like(y)
    grad_w = torch.empty(n_tokens * k, dtype=torch.float32, device=y.device)
    if n_tokens:
        d = y.shape[1]
        _combine_backward_kernel[(n_tokens * k,)](
            grad_out,
            y.contiguous(),
            inverse.contiguous(),
            weights.contiguous().float(),
            grad_y,
            grad_w,
            d,
            K=k,
            BLOCK=min(1024, triton.next_power_of_2(d)),
        )
    return grad_y, grad_w.view(n_tokens, k)


def combine_weight_grad(grad_out: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """dL/dweights[t, j] = grad_out[t] . y[inverse[t*k + j]] in fp32, [T, k]: the combine's weight
    gradient alone, for backwards that never form the per-row gradient (it goes into the GEMMs)."""
    n_tokens = inverse.numel() // k
    if not use_triton(y):
        rows = y.index_select(0, inverse).view(n_tokens, k, -1)
        return torch.bmm(rows.float(), grad_out.float().unsqueeze(2)).squeeze(2)
    grad_w = torch.empty(n_tokens * k, dtype=torch.float32, device=y.device)
    if n_tokens:
        d = y.shape[1]
        _combine_backward_kernel[(n_tokens * k,)](
            grad_out.contiguous(),
            y.contiguous(),
            inverse.contiguous(),
            grad_w,
            grad_w,
            grad_w,
            d,
            K=k,
            BLOCK=min(1024, triton.next_power_of_2(d)),
            WRITE_GRAD_Y=False,
        )
    return grad_w.view(n_tokens, k)
