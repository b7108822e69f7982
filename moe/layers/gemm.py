"""The expert GEMM seam: out[rows of group g] = x[rows of group g] @ w[g].T.

One small interface so FP8 (Hopper) and MXFP8 (Blackwell) kernels can replace the bf16
grouped GEMM without touching the MoE layer.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


class ExpertGemm(Protocol):
    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x: [N, K] rows sorted by group; w: [G, M, K]; offsets: [G] int32 cumulative row ends
        (on the device). Returns [N, M]."""
        ...


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return w.dtype


class GroupedMM:
    """torch's grouped GEMM (full speed in bf16 on sm90/sm100; runs on CPU too).

    Rows must have 16-byte strides (bf16: K and M multiples of 8). Empty groups are fine."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x, w)
        return _grouped_mm(x.to(dtype), w.to(dtype).transpose(-2, -1), offs=offsets)


_GEMMS: dict[str, type] = {"grouped_mm": GroupedMM}


def build_expert_gemm(name: str) -> ExpertGemm:
    try:
        return _GEMMS[name]()
    except KeyError:
        raise ValueError(f"model.moe.gemm: unknown expert GEMM {name!r}; known: {sorted(_GEMMS)}") from None
