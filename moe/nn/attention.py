"""Causal self-attention with OLMoE's QK-norm, grouped-query heads and RoPE, on SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe.config import ModelConfig
from moe.nn.norm import RMSNorm
from moe.nn.rope import RotaryEmbedding
from moe.nn.shared_input import shared_input_linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        d, kv_dim = cfg.d_model, cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        # OLMoE normalises the whole projection (all heads together), not each head.
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(kv_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = shared_input_linear(x, self.q_proj, self.k_proj, self.v_proj)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
