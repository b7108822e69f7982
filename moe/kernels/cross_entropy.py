"""Cross-entropy from bf16 logits in two Triton passes, the gradient written over the logits.

The torch loss turns the [tokens, vocab] bf16 logits into an fp32 copy, an fp32 log-softmax
(kept for backward), an fp32 gradient and its bf16 cast: about 14 bytes per logit and six passes
over the largest activation of a step (26 ms of a 670 ms step at OLMoE width, plus copies;
bench/NOTES.md). Here forward reads each row once in bf16 for its log-sum-exp (online, fp32) and
keeps the bf16 logits; backward reads them once more and writes ``g * (softmax - onehot) / count``
(plus the logit z-loss's ``2 w lse softmax``), formed in fp32 with the incoming gradient ``g`` and
cast once, as autograd's cast of torch's fp32 gradient does. (Forming it in forward, as
Liger-Kernel does, left a separate multiply by ``g``: 2 ms per micro-batch at OLMoE width.) With
``inplace`` the gradient overwrites the logits (the caller's logits are a temporary nobody reads
again): 2 bytes per logit at the peak instead of 14.

The count of counted tokens stays on the device (no host sync)."""

from __future__ import annotations

import torch

from moe.kernels.routing import HAVE_TRITON

IGNORE_INDEX = -100  # as F.cross_entropy

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_forward(logits, stride, target, loss_rows, lse_rows, V, IGNORE: tl.constexpr, BLOCK: tl.constexpr):
        """One row: its log-sum-exp (online, fp32) and its loss."""
        row = tl.program_id(0).to(tl.int64)
        src = logits + row * stride
        t = tl.load(target + row)
        valid = t != IGNORE
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            m = new_m
        lse = m + tl.log(s)
        picked = tl.load(src + tl.where(valid, t, 0)).to(tl.float32)
        tl.store(lse_rows + row, lse)
        tl.store(loss_rows + row, tl.where(valid, lse - picked, 0.0))

    @triton.jit
    def _ce_backward(
        logits, stride, target, grad, grad_stride, lse_rows, count_ptr, scale_ptr, V, z_weight, IGNORE: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One row's d loss / d logits in fp32, scaled by the incoming gradient, cast once."""
        row = tl.program_id(0).to(tl.int64)
        src = logits + row * stride
        t = tl.load(target + row)
        valid = t != IGNORE
        safe = tl.where(valid, t, 0)
        lse = tl.load(lse_rows + row)
        ce_coef = tl.where(valid, 1.0, 0.0) * (tl.load(scale_ptr).to(tl.float32) / tl.load(count_ptr).to(tl.float32))
        coef = ce_coef * (1.0 + 2.0 * z_weight * lse)
        dst = grad + row * grad_stride
        for start in range(0, V, BLOCK):  # may write over what it read (in place)
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(src + cols, mask=mask, other=float("-inf")).to(tl.float32)
            g = tl.exp(x - lse) * coef
            g = tl.where(cols == safe, g - ce_coef, g)
            tl.store(dst + cols, g.to(dst.dtype.element_ty), mask=mask)


BLOCK = 4096


def _launch(kernel, n: int, v: int, *args, **kwargs) -> None:
    if n:
        kernel[(n,)](*args, IGNORE=IGNORE_INDEX, BLOCK=min(BLOCK, triton.next_power_of_2(v)), num_warps=8, **kwargs)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, z_weight: float, inplace: bool) -> torch.Tensor:
        n, v = logits.shape
        count = (target != IGNORE_INDEX).sum()
        loss_rows = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse_rows = torch.empty(n, dtype=torch.float32, device=logits.device)
        _launch(_ce_forward, n, v, logits, logits.stride(0), target, loss_rows, lse_rows, v)
        ctx.save_for_backward(logits, target, lse_rows, count)
        ctx.z_weight, ctx.inplace = z_weight, inplace
        return loss_rows.sum() / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, lse_rows, count = ctx.saved_tensors
        n, v = logits.shape
        grad = logits if ctx.inplace else torch.empty_like(logits)
        scale = grad_loss.reshape(1).float()
        _launch(_ce_backward, n, v, logits, logits.stride(0), target, grad, grad.stride(0), lse_rows, count, scale, v, float(ctx.z_weight))
        return grad, None, None, None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, z_weight: float = 0.0, inplace: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [N, V] (bf16 or fp16, CUDA or Triton's interpreter)
    against ``target`` [N] (``IGNORE_INDEX`` skipped); ``z_weight`` adds the logit z-loss's
    gradient (not its value). ``inplace``: backward writes the gradient over ``logits``, so the
    caller must not read them after the loss (nor change them before its backward)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"fused_cross_entropy: logits must be [N, V] with contiguous rows, got shape {tuple(logits.shape)}")
    return _FusedCrossEntropy.apply(logits, target.contiguous(), z_weight, inplace)
