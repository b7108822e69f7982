"""Model and MoE-layer configs (the OLMoE architecture and its routing options)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from moe.config.base import Config, ConfigError, deep_merge, require

# Bounds far beyond any model trained today: larger values are typos that would only end in an
# allocation failure (a 1e9-position RoPE table is 512 GB).
MAX_SEQ_LEN = 1 << 20
MAX_VOCAB = 1 << 22
MAX_WIDTH = 1 << 17


@dataclasses.dataclass
class MoEConfig(Config):
    """One MoE feed-forward layer: router -> dispatcher -> experts -> combine."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 256
    # Router scores: softmax over experts (OLMoE) or independent sigmoids (DeepSeek-V3 style).
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    # Renormalise the k selected weights to sum to one (OLMoE: false).
    normalize_top_k: bool = False
    # "learned": top-k of the router scores. "random": uniformly random distinct experts
    # per token (system benchmarks, as the paper's), router weights still get gradients.
    routing: Literal["learned", "random"] = "learned"
    # Switch-style load-balancing loss E/k * sum_i f_i P_i (1.0 when perfectly balanced).
    lb_loss_weight: float = 0.01
    # micro_batch: f_i from this rank's micro-batch; global_batch: f_i from the token counts
    # summed over the data-parallel group (the same micro-batch step on every rank).
    lb_loss_scope: Literal["micro_batch", "global_batch"] = "micro_batch"
    z_loss_weight: float = 0.001
    # Auxiliary-loss-free balancing: per-expert selection bias moved by this step size
    # towards the mean load after every optimizer step; 0 disables it.
    bias_update_rate: float = 0.0
    num_shared_experts: int = 0
    shared_expert_hidden: int | None = None
    # The bf16 expert GEMM, the only one (kept as a key so that every stored config still loads):
    # which GEMM the experts run is chosen once, by precision.recipe when the model is built
    # (moe.precision.PrecisionRecipe.expert_gemm: grouped_mm, or an FP8 recipe's own). A Triton
    # fused expert MLP was measured slower than torch's grouped GEMM and removed (bench/NOTES.md, issue 38).
    gemm: Literal["grouped_mm"] = "grouped_mm"

    def _check(self, p: str) -> None:
        k = lambda name: f"{p}.{name}" if p else name  # noqa: E731
        require(self.num_experts >= 1, k("num_experts"), f"must be >= 1, got {self.num_experts}")
        require(self.num_experts <= 1 << 14, k("num_experts"), f"must be <= {1 << 14}, got {self.num_experts}")
        require(self.expert_hidden <= MAX_WIDTH, k("expert_hidden"), f"must be <= {MAX_WIDTH}, got {self.expert_hidden}")
        require(self.top_k >= 1, k("top_k"), f"must be >= 1, got {self.top_k}")
        require(
            self.top_k <= self.num_experts,
            k("top_k"),
            f"top_k={self.top_k} is larger than num_experts={self.num_experts}",
        )
        require(self.expert_hidden >= 1, k("expert_hidden"), "must be >= 1")
        require(self.lb_loss_weight >= 0, k("lb_loss_weight"), "must be >= 0")
        require(self.z_loss_weight >= 0, k("z_loss_weight"), "must be >= 0")
        require(self.bias_update_rate >= 0, k("bias_update_rate"), "must be >= 0")
        require(self.num_shared_experts >= 0, k("num_shared_experts"), "must be >= 0")
        if self.shared_expert_hidden is not None:
            require(self.shared_expert_hidden >= 1, k("shared_expert_hidden"), "must be >= 1")

    @property
    def shared_hidden_total(self) -> int:
        return self.num_shared_experts * (self.shared_expert_hidden or self.expert_hidden)


@dataclasses.dataclass
class ModelConfig(Config):
    """Decoder-only transformer with the OLMoE architecture (maps onto OlmoeForCausalLM)."""

    vocab_size: int = 512
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # OLMoE's QK-norm: RMSNorm over the whole q (and k) projection before splitting heads.
    qk_norm: bool = True
    tie_embeddings: bool = False
    # Layers that use a dense SwiGLU MLP instead of an MoE layer (e.g. [0]).
    dense_layers: list[int] = dataclasses.field(default_factory=list)
    dense_hidden: int | None = None
    init_std: float = 0.02
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    # Name of the preset this config started from (informational; set by "preset:"). Explicit
    # keys win over the preset's; those that differ from it are listed in preset_overrides
    # (computed, never read), so a run is never labelled a preset it does not match.
    preset: str | None = None
    preset_overrides: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def _expand(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        name = data.get("preset")
        data = {k: v for k, v in data.items() if k != "preset_overrides"}
        if name is None:
            return data
        from moe.config.presets import model_preset

        key = f"{prefix}.preset" if prefix else "preset"
        if not isinstance(name, str):
            raise ConfigError(f"{key}: expected a preset name, got {name!r}")
        preset = model_preset(name, key)
        merged = deep_merge(preset, data)
        merged["preset_overrides"] = sorted(_differing(preset, data))
        return merged

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def architecture(self) -> dict[str, Any]:
        """What the weights' shapes and the forward pass depend on: two configs with equal
        architectures load each other's weights and compute the same function. Not in it:
        the preset bookkeeping, max_seq_len (RoPE has no learned positions), init_std and the
        training losses' weights."""
        m = self.moe
        dense = sorted(self.dense_layers)
        return {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.kv_heads,
            "rope_theta": self.rope_theta,
            "norm_eps": self.norm_eps,
            "qk_norm": self.qk_norm,
            "tie_embeddings": self.tie_embeddings,
            "dense_layers": dense,
            "dense_hidden": self.dense_hidden if dense else None,
            "moe.num_experts": m.num_experts,
            "moe.top_k": m.top_k,
            "moe.expert_hidden": m.expert_hidden,
            "moe.score_func": m.score_func,
            "moe.normalize_top_k": m.normalize_top_k,
            "moe.routing": m.routing,
            "moe.num_shared_experts": m.num_shared_experts,
            "moe.shared_hidden_total": m.shared_hidden_total,
            "moe.routing_bias": m.bias_update_rate > 0,
        }

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def is_moe_layer(self, index: int) -> bool:
        return index not in set(self.dense_layers)

    def _check(self, p: str) -> None:
        k = lambda name: f"{p}.{name}" if p else name  # noqa: E731
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            require(getattr(self, name) >= 1, k(name), f"must be >= 1, got {getattr(self, name)}")
        for name, limit in (("max_seq_len", MAX_SEQ_LEN), ("vocab_size", MAX_VOCAB), ("d_model", MAX_WIDTH), ("n_layers", 4096)):
            require(getattr(self, name) <= limit, k(name), f"must be <= {limit}, got {getattr(self, name)}")
        require(
            self.d_model % self.n_heads == 0,
            k("d_model"),
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}",
        )
        require(self.head_dim % 2 == 0, k("n_heads"), f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_kv_heads is not None:
            require(self.n_kv_heads >= 1, k("n_kv_heads"), "must be >= 1")
            require(
                self.n_heads % self.n_kv_heads == 0,
                k("n_kv_heads"),
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}",
            )
        for i in self.dense_layers:
            require(0 <= i < self.n_layers, k("dense_layers"), f"layer {i} is outside 0..{self.n_layers - 1}")
        require(len(set(self.dense_layers)) == len(self.dense_layers), k("dense_layers"), "has duplicates")
        if self.dense_layers:
            require(
                self.dense_hidden is not None and self.dense_hidden >= 1,
                k("dense_hidden"),
                "must be set (>= 1) when dense_layers is not empty",
            )
        require(self.init_std > 0, k("init_std"), "must be > 0")
        require(self.norm_eps > 0, k("norm_eps"), "must be > 0")
        require(self.rope_theta > 0, k("rope_theta"), "must be > 0")


def _differing(preset: dict[str, Any], explicit: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys the preset sets that ``explicit`` sets to another value."""
    out = []
    for k, v in explicit.items():
        if k == "preset" or k not in preset:
            continue
        if isinstance(v, dict) and isinstance(preset[k], dict):
            out += _differing(preset[k], v, f"{prefix}{k}.")
        elif v != preset[k]:
            out.append(f"{prefix}{k}")
    return out
