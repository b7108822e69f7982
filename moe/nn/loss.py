"""The language-model loss, built in one place for every layout (one process, data parallel,
the last pipeline stage): mean cross-entropy over the tokens, from the logits or (``chunk``)
from the normed hidden states through the fused, chunked head that never holds all logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.nn.chunked_ce import chunked_linear_cross_entropy


def lm_loss(output: torch.Tensor, target: torch.Tensor, head_weight: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """``output``: logits [B, T, V], or hidden states [B, T, D] when ``chunk`` > 0 (then
    ``head_weight`` [V, D] is applied chunk by chunk). fp32 whatever the recipe."""
    if chunk:
        return chunked_linear_cross_entropy(output, head_weight, target, chunk)
    return F.cross_entropy(output.flatten(0, 1).float(), target.reshape(-1))
