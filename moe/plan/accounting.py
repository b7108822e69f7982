"""Parameter counts and FLOPs per token, from the model config alone (no model is built).

FLOPs per token follow the PaLM convention: 6 x (active matmul parameters, including the
output head and the router, counting only the top-k routed experts) for forward and backward,
plus the attention term 12 x layers x seq_len x (heads x head_dim), with no discount for the
causal mask. The embedding lookup is not a matmul and is not counted.
"""

from __future__ import annotations

import dataclasses

from moe.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    embedding: int  # input embedding (and the head when tied)
    matmul_active: int  # what enters the 6N term


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Parameters of the model ``cfg`` describes (active: the top_k routed experts of each MoE
    layer), counted from its shapes; equal to a built model's (tests/plan/test_accounting.py)."""
    d, v, moe = cfg.d_model, cfg.vocab_size, cfg.moe
    kv_dim = cfg.kv_heads * cfg.head_dim
    attn = 2 * d * d + 2 * d * kv_dim
    qk_norm = (d + kv_dim) if cfg.qk_norm else 0
    norms = 2 * d
    total = active = matmul = 0
    for i in range(cfg.n_layers):
        layer_total = layer_active = attn + qk_norm + norms
        layer_matmul = attn
        if cfg.is_moe_layer(i):
            expert = 3 * d * moe.expert_hidden
            shared = 3 * d * moe.shared_hidden_total
            router = moe.num_experts * d
            layer_total += router + moe.num_experts * expert + shared
            layer_active += router + moe.top_k * expert + shared
            layer_matmul += router + moe.top_k * expert + shared
        else:
            dense = 3 * d * cfg.dense_hidden
            layer_total += dense
            layer_active += dense
            layer_matmul += dense
        total += layer_total
        active += layer_active
        matmul += layer_matmul
    embedding = v * d
    head = 0 if cfg.tie_embeddings else v * d
    final_norm = d
    total += embedding + head + final_norm
    active += embedding + head + final_norm
    matmul += v * d  # the output projection runs whether or not it is tied
    return ParamCounts(total=total, active=active, embedding=embedding, matmul_active=matmul)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token."""
    attention = 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6.0 * param_counts(cfg).matmul_active + attention
