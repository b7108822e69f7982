"""Rotary position embeddings in the rotate-half convention of Llama/OLMoE checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from moe.kernels.rope import apply_rope


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions 0..max_seq_len-1 (not saved in checkpoints)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables(None)  # the default device (e.g. inside `with torch.device("cuda")`)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim))
        positions = torch.arange(self.max_seq_len, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def reset_parameters(self) -> None:
        """Recompute the tables (after moving a meta-initialised model to a real device)."""
        cos, sin = self._tables(self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [batch, heads, seq, head_dim]."""
        seq = q.shape[-2]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.max_seq_len}")
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
