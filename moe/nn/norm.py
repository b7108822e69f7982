"""RMSNorm, computed in fp32 and scaled after the cast back (as transformers' OLMoE does).

The computation lives in ``moe.kernels.rmsnorm``: the fused Triton kernels on CUDA, the eager
reference (``rms_norm_reference``) on the CPU and for shapes the kernels do not take."""

from __future__ import annotations

import torch
from torch import nn

from moe.kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
