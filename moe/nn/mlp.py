"""Dense SwiGLU feed-forward (dense layers and shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe.nn.shared_input import shared_input_linear


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = shared_input_linear(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)
