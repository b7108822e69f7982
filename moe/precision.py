"""Precision recipes (a seam: FP8 / MXFP8 recipes plug in here).

A recipe says how weights are stored, whether the optimizer keeps fp32 master copies, and
which autocast context wraps forward and backward. Router logits and the loss are computed in
fp32 by the model and trainer whatever the recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from moe.config import ConfigError


@dataclasses.dataclass(frozen=True)
class PrecisionRecipe:
    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    # Whether its kernels are fixed-order (train.deterministic refuses a recipe that is not).
    deterministic = True

    @property
    def master_weights(self) -> bool:
        """The optimizer steps fp32 copies when the model's own weights are lower precision."""
        return self.param_dtype != torch.float32

    def prepare(self, model: nn.Module) -> nn.Module:
        """Cast the model's floating-point parameters (buffers such as RoPE tables stay fp32)."""
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != self.param_dtype:
                param.data = param.data.to(self.param_dtype)
        return model

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device.type, dtype=self.autocast_dtype):
            yield


RECIPES = {
    "fp32": PrecisionRecipe("fp32", torch.float32, None),
    "bf16": PrecisionRecipe("bf16", torch.bfloat16, torch.bfloat16),
    "amp_bf16": PrecisionRecipe("amp_bf16", torch.float32, torch.bfloat16),
}


def resolve_recipe(name: str, device: torch.device) -> PrecisionRecipe:
    """``auto`` is bf16 on CUDA and fp32 on CPU."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    try:
        return RECIPES[name]
    except KeyError:
        raise ConfigError(f"precision.recipe: unknown recipe {name!r}; known: auto, {', '.join(RECIPES)}") from None
