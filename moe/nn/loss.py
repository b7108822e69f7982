"""The language-model loss, built in one place for every layout (one process, data parallel,
the last pipeline stage): mean cross-entropy over the tokens, from the logits or (``chunk``)
from the normed hidden states through the fused, chunked head that never holds all logits.
``fused`` (``train.fused_loss``): bf16 logits on the GPU go through one Triton kernel that forms
the gradient in forward (moe.kernels.cross_entropy); elsewhere the torch loss below.

``z_weight`` adds Olmo-core's output-logit z-loss, ``z_weight * mean(logsumexp(logits)^2)``
(``train.logit_z_loss_weight``; 1e-5 in its OLMoE-1B-7B script), to the gradient. The value
returned stays the cross-entropy, so the logged loss and perplexity mean what they say.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.kernels.cross_entropy import fused_cross_entropy
from moe.kernels.routing import use_triton
from moe.nn.chunked_ce import chunked_linear_cross_entropy


class _CrossEntropyWithLogitZLoss(torch.autograd.Function):
    """Mean cross-entropy of fp32 ``logits`` [N, V] (targets -100 ignored, as F.cross_entropy);
    the backward also carries ``weight * mean(logsumexp(logits)^2)``'s gradient (the mean over
    the counted tokens, as the chunked head's). One function so
    the backward writes one [N, V] gradient: autograd on the two losses apart kept the fp32
    logits for logsumexp and summed two [N, V] gradients into a third (8 bytes x vocabulary per
    token more at the peak, measured 10.4 GiB at OLMoE width and 64K tokens; issue 36)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, weight: float) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)
        valid = target != -100
        safe = torch.where(valid, target, 0)
        picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
        count = valid.sum().to(logits.dtype)
        ce = torch.where(valid, lse - picked, 0.0).sum() / count
        ctx.save_for_backward(logits, lse, safe, valid, count)
        ctx.weight = weight
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, safe, valid, count = ctx.saved_tensors
        # d/dlogits = g * valid / count * (softmax - onehot + weight * 2 * lse * softmax)
        ce_coef = valid.to(logits.dtype) * (grad / count)
        coef = ce_coef * (1.0 + 2.0 * ctx.weight * lse)
        out = torch.exp(logits - lse.unsqueeze(1))
        out.mul_(coef.unsqueeze(1))
        out.scatter_add_(1, safe.unsqueeze(1), -ce_coef.unsqueeze(1))
        return out, None, None


def lm_loss(
    output: torch.Tensor,
    target: torch.Tensor,
    head_weight: torch.Tensor | None = None,
    chunk: int = 0,
    z_weight: float = 0.0,
    fused: bool = False,
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """``output``: logits [B, T, V], or hidden states [B, T, D] when ``chunk`` > 0 (then
    ``head_weight`` [V, D] is applied chunk by chunk). fp32 whatever the recipe.
    ``overwrite_logits``: the fused kernel may write the gradient over the logits (the caller
    never reads them again)."""
    if chunk:
        return chunked_linear_cross_entropy(output, head_weight, target, chunk, z_weight)
    if fused and output.dtype in (torch.bfloat16, torch.float16) and use_triton(output):
        return fused_cross_entropy(output.flatten(0, 1), target.reshape(-1), z_weight, inplace=overwrite_logits)
    logits = output.flatten(0, 1).float()
    if not z_weight:
        return F.cross_entropy(logits, target.reshape(-1))
    return _CrossEntropyWithLogitZLoss.apply(logits, target.reshape(-1), z_weight)
