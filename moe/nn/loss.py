"""The language-model loss, built in one place for every layout (one process, data parallel,
the last pipeline stage): mean cross-entropy over the tokens, from the logits or (``chunk``)
from the normed hidden states through the fused, chunked head that never holds all logits.

``z_weight`` adds Olmo-core's output-logit z-loss, ``z_weight * mean(logsumexp(logits)^2)``
(``train.logit_z_loss_weight``; 1e-5 in its OLMoE-1B-7B script), to the gradient. The value
returned stays the cross-entropy, so the logged loss and perplexity mean what they say.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.nn.chunked_ce import chunked_linear_cross_entropy


class _WithLogitZLoss(torch.autograd.Function):
    """``ce`` unchanged; backward also sends ``weight`` times the incoming gradient to ``z``."""

    @staticmethod
    def forward(ctx, ce: torch.Tensor, z: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return ce.view_as(ce)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad * ctx.weight, None


def lm_loss(
    output: torch.Tensor, target: torch.Tensor, head_weight: torch.Tensor | None = None, chunk: int = 0, z_weight: float = 0.0
) -> torch.Tensor:
    """``output``: logits [B, T, V], or hidden states [B, T, D] when ``chunk`` > 0 (then
    ``head_weight`` [V, D] is applied chunk by chunk). fp32 whatever the recipe."""
    if chunk:
        return chunked_linear_cross_entropy(output, head_weight, target, chunk, z_weight)
    logits = output.flatten(0, 1).float()
    ce = F.cross_entropy(logits, target.reshape(-1))
    if not z_weight:
        return ce
    return _WithLogitZLoss.apply(ce, torch.logsumexp(logits, dim=-1).square().mean(), z_weight)
