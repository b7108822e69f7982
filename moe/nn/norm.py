"""RMSNorm with fp32 statistics.

The computation lives in ``moe.kernels.rmsnorm``: torch's fused ``F.rms_norm`` on CUDA where x
and the weight share a dtype (it rounds once, bf16(x * rstd * w), about one bf16 step from
OLMoE's order), our Triton kernels for mixed dtypes, and on the CPU the eager reference
(``rms_norm_reference``), which scales after the cast back exactly as transformers' OLMoE does."""

from __future__ import annotations

import torch
from torch import nn

from moe.kernels.rmsnorm import rms_norm, rms_norm_with_residual


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def with_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x for the residual stream, the normalised x): the same values as (x, self(x)), with
        both gradients of x summed in the norm's backward pass where the fused path runs."""
        return rms_norm_with_residual(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
