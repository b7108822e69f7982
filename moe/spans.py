"""Named profiler ranges at the library's seams, so a step profile can say where time went.

``span("dispatch")`` around the token permutation, ``span("grad_accumulation")`` around the
gradient adds, and so on (:mod:`moe.train.step_profile` sums a trace by these names). With no
profiler running a span costs one flag check, so the seams keep it in the hot path.
"""

from __future__ import annotations

import contextlib

import torch

CATEGORIES = (
    "expert_gemm",
    "dense_gemm",
    "attention",
    "dispatch",
    "fp8_quantize",
    "grad_accumulation",
    "grad_sync",
    "optimizer",
    "other",
)


def span(category: str) -> contextlib.AbstractContextManager:
    """A profiler range naming the category of everything launched inside it."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown profile category {category!r}; known: {', '.join(CATEGORIES)}")
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(f"moe.{category}")
    return contextlib.nullcontext()
