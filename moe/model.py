"""Decoder-only OLMoE-style transformer.

Layers live in a ModuleDict keyed by their global index so that a pipeline stage can drop the
layers (and the embedding, final norm or head) it does not own and keep checkpoint names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from moe.config import ModelConfig
from moe.layers.gemm import ExpertGemm, GroupedMM
from moe.layers.moe_layer import MoELayer
from moe.nn.attention import Attention
from moe.nn.mlp import SwiGLU
from moe.nn.norm import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, expert_gemm: Callable[[], ExpertGemm] = GroupedMM) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp: nn.Module = MoELayer(cfg.d_model, cfg.moe, expert_gemm) if cfg.is_moe_layer(index) else SwiGLU(cfg.d_model, cfg.dense_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x + attn(attn_norm(x)), then h + mlp(mlp_norm(h)); each norm hands back the residual so
        # that its backward adds the residual's gradient in its own pass (RMSNorm.with_residual)
        x, normed = self.attn_norm.with_residual(x)
        x = x + self.attn(normed)
        x, normed = self.mlp_norm.with_residual(x)
        if isinstance(self.mlp, MoELayer):
            return self.mlp(normed, residual=x)  # the layer adds it (in the combine's pass where it can)
        return x + self.mlp(normed)


def run_stack(m: nn.Module, x: torch.Tensor, head: bool = True) -> torch.Tensor:
    """embed -> layers -> norm -> head, skipping the parts a pipeline stage does not own.

    ``head=False`` stops after the final norm, for a loss that applies ``lm_head`` itself
    (moe.nn.chunked_ce)."""
    h = m.embed(x) if m.embed is not None else x
    for layer in m.layers.values():
        h = layer(h)
    if m.norm is not None:
        h = m.norm(h)
    return m.lm_head(h) if head and m.lm_head is not None else h


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_gemm: Callable[[], ExpertGemm] | None = None) -> None:
        """``expert_gemm`` builds every MoE layer's expert GEMM, chosen once, here: the precision
        recipe's (``PrecisionRecipe.expert_gemm``); None: torch's grouped GEMM (bf16)."""
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, expert_gemm or GroupedMM) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] -> logits [B, S, V] (a pipeline stage may take/return hidden states)."""
        return run_stack(self, x)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for every weight matrix, ones for norms (as transformers' OLMoE)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, MoELayer):
                module.reset_parameters(std)
        for module in self.modules():
            if hasattr(module, "rope"):
                module.rope.reset_parameters()

    def moe_layers(self) -> Iterator[tuple[str, MoELayer]]:
        for name, layer in self.layers.items():
            if isinstance(layer.mlp, MoELayer):
                yield name, layer.mlp

    def set_aux_loss_scale(self, scale: float) -> None:
        for _, layer in self.moe_layers():
            layer.aux_loss_scale = scale

    def update_expert_biases(self) -> None:
        """Aux-loss-free balancing: call after each optimizer step (device-only)."""
        for _, layer in self.moe_layers():
            layer.router.update_bias()
