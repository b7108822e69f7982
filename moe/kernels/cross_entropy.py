"""Cross-entropy from bf16 logits in one Triton kernel, its gradient written in the same pass.

The torch loss turns the [tokens, vocab] bf16 logits into an fp32 copy, an fp32 log-softmax
(kept for backward), an fp32 gradient and its bf16 cast: about 14 bytes per logit and six passes
over the largest activation of a step (26 ms of a 670 ms step at OLMoE width, plus copies;
bench/NOTES.md). Here each row is read twice in bf16: once for its log-sum-exp (online, fp32),
once to write ``(softmax - onehot) / count`` (plus the logit z-loss's ``2 w lse softmax``) as bf16,
which is what autograd's cast of the fp32 gradient produced. Since the loss is the last node of
the graph, the gradient is formed in forward (as Liger-Kernel does) and backward only scales it
by the incoming gradient. With ``inplace`` the gradient overwrites the logits (the caller's
logits are a temporary nobody reads again): 2 bytes per logit at the peak instead of 14.

The count of counted tokens stays on the device (no host sync)."""

from __future__ import annotations

import torch

from moe.kernels.routing import HAVE_TRITON

IGNORE_INDEX = -100  # as F.cross_entropy

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_fwd_grad(
        logits, stride, target, grad, grad_stride, loss_rows, count_ptr, V, z_weight, IGNORE: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        src = logits + row * stride
        t = tl.load(target + row)
        valid = t != IGNORE
        safe = tl.where(valid, t, 0)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):  # online log-sum-exp
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            m = new_m
        lse = m + tl.log(s)
        picked = tl.load(src + safe).to(tl.float32)
        tl.store(loss_rows + row, tl.where(valid, lse - picked, 0.0))
        ce_coef = tl.where(valid, 1.0, 0.0) / tl.load(count_ptr).to(tl.float32)
        coef = ce_coef * (1.0 + 2.0 * z_weight * lse)
        dst = grad + row * grad_stride
        for start in range(0, V, BLOCK):  # d loss / d logits, written over what was read
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(src + cols, mask=mask, other=float("-inf")).to(tl.float32)
            g = tl.exp(x - lse) * coef
            g = tl.where(cols == safe, g - ce_coef, g)
            tl.store(dst + cols, g.to(dst.dtype.element_ty), mask=mask)


BLOCK = 4096


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, z_weight: float, inplace: bool) -> torch.Tensor:
        n, v = logits.shape
        valid = target != IGNORE_INDEX
        count = valid.sum()
        grad = logits if inplace else torch.empty_like(logits)
        loss_rows = torch.empty(n, dtype=torch.float32, device=logits.device)
        if n:
            _ce_fwd_grad[(n,)](
                logits, logits.stride(0), target, grad, grad.stride(0), loss_rows, count, v, float(z_weight),
                IGNORE=IGNORE_INDEX, BLOCK=min(BLOCK, triton.next_power_of_2(v)), num_warps=8,
            )  # fmt: skip
        ctx.save_for_backward(grad)
        return loss_rows.sum() / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss.to(grad.dtype)), None, None, None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, z_weight: float = 0.0, inplace: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [N, V] (bf16 or fp16, CUDA or Triton's interpreter)
    against ``target`` [N] (``IGNORE_INDEX`` skipped); ``z_weight`` adds the logit z-loss's
    gradient (not its value). ``inplace``: the gradient overwrites ``logits`` during forward, so
    the caller must not read them again. The incoming gradient is applied after the bf16 cast
    (exact when it is a power of two, as 1 / micro-batches is for the usual counts)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"fused_cross_entropy: logits must be [N, V] with contiguous rows, got shape {tuple(logits.shape)}")
    return _FusedCrossEntropy.apply(logits, target.contiguous(), z_weight, inplace)
