"""Figures of the real expert load, computed on the device from token counts.

The balance loss scores router probabilities against token fractions and can improve while
the real load gets worse (the paper's "token gerrymandering"); these figures look at the
counts alone. All take and return device tensors, so callers bring them to the host once,
at a log point."""

from __future__ import annotations

import math

import torch

# Columns of :func:`load_stats`, in order; the metric of column c for layer L is
# ``expert_load_<c>/layer_L``.
LOAD_STATS = ("max_over_mean", "min_over_mean", "cv", "idle", "entropy")


def load_stats(counts: torch.Tensor) -> torch.Tensor:
    """[L, E] tokens per expert -> [L, 5] float64: max/mean, min/mean, coefficient of
    variation (population std / mean), idle experts (no token), and the entropy of the load
    normalised by log E (1 = perfectly even). A layer that saw no tokens gets zeros."""
    c = counts.to(torch.float64)
    num_experts = c.shape[-1]
    mean = c.mean(dim=-1)
    seen = mean > 0
    safe = torch.where(seen, mean, torch.ones_like(mean))
    p = c / (safe * num_experts).unsqueeze(-1)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1) / (math.log(num_experts) if num_experts > 1 else 1.0)
    out = torch.stack(
        [
            c.amax(dim=-1) / safe,
            c.amin(dim=-1) / safe,
            c.std(dim=-1, correction=0) / safe,
            (counts == 0).sum(dim=-1).to(torch.float64),
            entropy,
        ],
        dim=-1,
    )
    return torch.where(seen.unsqueeze(-1), out, torch.zeros_like(out))


def relative_load(counts: torch.Tensor) -> torch.Tensor:
    """[L, E] tokens per expert -> each expert's load over its layer's mean (1 = average)."""
    c = counts.to(torch.float64)
    mean = c.mean(dim=-1, keepdim=True)
    return torch.where(mean > 0, c / torch.where(mean > 0, mean, torch.ones_like(mean)), torch.zeros_like(c))


def max_over_mean(rows: torch.Tensor) -> torch.Tensor:
    """[R, L] rows received per rank -> [L]: the busiest rank's rows over the mean over ranks,
    the factor by which the slowest rank's expert work exceeds the average."""
    r = rows.to(torch.float64)
    mean = r.mean(dim=0)
    return torch.where(mean > 0, r.amax(dim=0) / torch.where(mean > 0, mean, torch.ones_like(mean)), torch.zeros_like(mean))
