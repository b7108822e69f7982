"""Name and layout mapping between our model and transformers' ``OlmoeForCausalLM``.

Pure tensor/dict work (no transformers import): the pipeline's convert stage does the file
I/O. HF checkpoints are written in the published per-expert layout
(``mlp.experts.{e}.gate_proj.weight`` ...), which every transformers version since 4.45
loads (v5 fuses it on load); reading accepts that layout and v5's fused one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from moe.config import ConfigError, ModelConfig

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

_DENSE_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_DENSE_NAMES_REV = {v: k for k, v in _DENSE_NAMES.items()}


class ConversionError(ConfigError):
    """The model or checkpoint cannot be expressed in the other format."""


def check_expressible(cfg: ModelConfig, routing_bias: bool = False) -> None:
    """Raise naming the first option transformers' OLMoE cannot express."""
    moe = cfg.moe
    problems = [
        (bool(cfg.dense_layers), "model.dense_layers", "OLMoE has no dense MLP layers"),
        (moe.num_shared_experts > 0, "model.moe.num_shared_experts", "OLMoE has no shared experts"),
        (moe.score_func != "softmax", "model.moe.score_func", "OLMoE routes with softmax scores only"),
        (not cfg.qk_norm, "model.qk_norm", "OLMoE always applies QK-norm"),
        (moe.routing != "learned", "model.moe.routing", "OLMoE routes with its learned router only"),
        (
            moe.bias_update_rate > 0 or routing_bias,
            "model.moe.bias_update_rate",
            "OLMoE has no expert selection bias (aux-loss-free balancing)",
        ),
    ]
    for bad, key, why in problems:
        if bad:
            raise ConversionError(f"{key}: cannot convert to Hugging Face OLMoE: {why}")


def hf_config(cfg: ModelConfig, *, eos_id: int, pad_id: int | None, bos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    check_expressible(cfg)
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.moe.expert_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "num_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "norm_topk_prob": cfg.moe.normalize_top_k,
        "router_aux_loss_coef": cfg.moe.lb_loss_weight,
        "output_router_logits": False,
        "use_cache": True,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": bos_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


# config.json keys model_config_from_hf maps onto ours.
HF_MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "tie_word_embeddings", "num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
})
# Settings our model has exactly one value of: anything else is refused by name.
HF_FIXED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "clip_qkv": (None,),
    "attention_bias": (False, None),
    "attention_dropout": (0, 0.0, None),
    "pretraining_tp": (1, None),
    "mlp_bias": (False, None),
}
# What leaves the forward pass alone: identity, token ids, dtype, caching/outputs, generation
# defaults and the other generic PretrainedConfig fields.
HF_IGNORED = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
    "output_router_logits", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "id2label", "label2id", "problem_type",
    "torchscript", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "quantization_config_dict",
})


def check_hf_settings(hf: Mapping[str, Any], source: str = "config.json") -> None:
    """Refuse, by name, every setting of an HF OLMoE config that our model would not reproduce."""
    for key, value in hf.items():
        if key in HF_FIXED:
            if not any(value == ok and type(value) is type(ok) or (value is None and ok is None) for ok in HF_FIXED[key]):
                expected = " or ".join(repr(v) for v in HF_FIXED[key] if v is not None)
                raise ConversionError(f"{source}: {key}={value!r} is not supported (our model has {key}={expected})")
        elif key not in HF_MAPPED and key not in HF_IGNORED:
            raise ConversionError(f"{source}: {key}={value!r} is not expressed by the OLMoE converter; refusing rather than ignoring it")


def model_config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Our ModelConfig for an HF OLMoE config.json mapping."""
    model_type = hf.get("model_type")
    if model_type != "olmoe":
        raise ConversionError(f"{source}: model_type is {model_type!r}, not 'olmoe'; only OLMoE checkpoints convert")
    check_hf_settings(hf, source)
    if hf.get("clip_qkv") is not None:
        raise ConversionError(f"{source}: clip_qkv={hf['clip_qkv']} is not supported")
    if hf.get("attention_bias"):
        raise ConversionError(f"{source}: attention_bias=true is not supported")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    if (rope.get("rope_type") or "default") != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise ConversionError(f"{source}: only default RoPE is supported")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    data = {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads") or None,
        "max_seq_len": hf.get("max_position_embeddings", 4096),
        "rope_theta": float(theta),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "qk_norm": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "moe": {
            "num_experts": hf["num_experts"],
            "top_k": hf["num_experts_per_tok"],
            "expert_hidden": hf["intermediate_size"],
            "normalize_top_k": bool(hf.get("norm_topk_prob", False)),
            "lb_loss_weight": float(hf.get("router_aux_loss_coef", 0.01)),
        },
    }
    if data["n_kv_heads"] == data["n_heads"]:
        data["n_kv_heads"] = None
    return ModelConfig.from_dict(data, prefix="model").validate("model")


def to_hf(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter names -> HF OLMoE names (per-expert layout)."""
    check_expressible(cfg)
    out: dict[str, torch.Tensor] = {}
    hidden = cfg.moe.expert_hidden
    for name, t in state.items():
        if name == "embed.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "norm.weight":
            out["model.norm.weight"] = t
        elif name == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = t
        elif m := _LAYER.match(name):
            i, rest = m.groups()
            prefix = f"model.layers.{i}."
            if rest in _DENSE_NAMES:
                out[prefix + _DENSE_NAMES[rest]] = t
            elif rest == "mlp.experts.gate_up":
                for e in range(t.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :hidden]
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, hidden:]
            elif rest == "mlp.experts.down":
                for e in range(t.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
            elif rest == "mlp.router.expert_bias":
                if torch.count_nonzero(t):
                    raise ConversionError(
                        f"{name}: cannot convert to Hugging Face OLMoE: it has no expert selection bias"
                    )
            else:
                raise ConversionError(f"{name}: no Hugging Face OLMoE counterpart")
        else:
            raise ConversionError(f"{name}: no Hugging Face OLMoE counterpart")
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF OLMoE names (per-expert or fused layout) -> our parameter names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in hf_state.items():
        if name == "model.embed_tokens.weight":
            out["embed.weight"] = t
        elif name == "model.norm.weight":
            out["norm.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        elif m := _HF_LAYER.match(name):
            i, rest = int(m.group(1)), m.group(2)
            if rest in _DENSE_NAMES_REV:
                out[f"layers.{i}.{_DENSE_NAMES_REV[rest]}"] = t
            elif em := re.match(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", rest):
                experts.setdefault((i, em.group(2)), {})[int(em.group(1))] = t
            elif rest == "mlp.experts.gate_up_proj":
                out[f"layers.{i}.mlp.experts.gate_up"] = t
            elif rest == "mlp.experts.down_proj":
                out[f"layers.{i}.mlp.experts.down"] = t
            elif rest.endswith("rotary_emb.inv_freq"):
                continue
            else:
                raise ConversionError(f"{source}: tensor {name} has no counterpart in our OLMoE model")
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        else:
            raise ConversionError(f"{source}: tensor {name} has no counterpart in our OLMoE model")
    n_exp = cfg.moe.num_experts
    for i in range(cfg.n_layers):
        parts = {kind: experts.get((i, kind), {}) for kind in ("gate_proj", "up_proj", "down_proj")}
        if not any(parts.values()):
            continue
        for kind, got in parts.items():
            missing = sorted(set(range(n_exp)) - set(got))
            if missing:
                raise ConversionError(f"{source}: model.layers.{i}.mlp.experts.{missing[0]}.{kind}.weight is missing")
        gate = torch.stack([parts["gate_proj"][e] for e in range(n_exp)])
        up = torch.stack([parts["up_proj"][e] for e in range(n_exp)])
        out[f"layers.{i}.mlp.experts.gate_up"] = torch.cat([gate, up], dim=1)
        out[f"layers.{i}.mlp.experts.down"] = torch.stack([parts["down_proj"][e] for e in range(n_exp)])
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    elif "lm_head.weight" not in out and "embed.weight" in out:
        raise ConversionError(f"{source}: lm_head.weight is missing and tie_word_embeddings is false")
    return out
