"""Name and layout mapping between our model and transformers' ``OlmoeForCausalLM``.

Pure tensor/dict work (no transformers import): the pipeline's convert stage does the file
I/O. HF checkpoints are written in the published per-expert layout
(``mlp.experts.{e}.gate_proj.weight`` ...), which every transformers version since 4.45
loads (v5 fuses it on load); reading accepts that layout and v5's fused one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from moe.config import ConfigError, ModelConfig

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# At most 9 digits: a hostile name's 5000-digit index would make int() raise (Python's digit limit).
_HF_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.(.+)$")

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
HF_MAPPED = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "tie_word_embeddings",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "router_aux_loss_coef",
    }
)
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
HF_IGNORED = frozenset(
    {
        "model_type",
        "architectures",
        "transformers_version",
        "_name_or_path",
        "torch_dtype",
        "dtype",
        "use_cache",
        "output_router_logits",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "torchscript",
        "pruned_heads",
        "tf_legacy_loss",
        "use_bfloat16",
        "finetuning_task",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "quantization_config_dict",
    }
)


def check_hf_settings(hf: Mapping[str, Any], source: str = "config.json") -> None:
    """Refuse, by name, every setting of an HF OLMoE config that our model would not reproduce."""
    for key, value in hf.items():
        if key in HF_FIXED:
            if not any(value == ok and type(value) is type(ok) or (value is None and ok is None) for ok in HF_FIXED[key]):
                expected = " or ".join(repr(v) for v in HF_FIXED[key] if v is not None)
                raise ConversionError(f"{source}: {key}={value!r} is not supported (our model has {key}={expected})")
        elif key not in HF_MAPPED and key not in HF_IGNORED:
            raise ConversionError(f"{source}: {key}={value!r} is not expressed by the OLMoE converter; refusing rather than ignoring it")


# config.json's typed settings: what each must hold (JSON types, checked before any use).
_HF_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_experts",
    "num_experts_per_tok",
)
_HF_OPTIONAL: dict[str, tuple[str, Any]] = {  # key -> (kind, value when absent)
    "num_key_value_heads": ("integer or null", None),
    "max_position_embeddings": ("integer", 4096),
    "rope_theta": ("number", 10000.0),
    "rms_norm_eps": ("number", 1e-5),
    "initializer_range": ("number", 0.02),
    "router_aux_loss_coef": ("number", 0.01),
    "tie_word_embeddings": ("bool", False),
    "norm_topk_prob": ("bool", False),
    "rope_parameters": ("object or null", None),
    "rope_scaling": ("object or null", None),
}
# Our dotted keys -> the config.json key they come from, so that a range error names the file's key.
_HF_KEY_OF = {
    "model.vocab_size": "vocab_size",
    "model.d_model": "hidden_size",
    "model.n_layers": "num_hidden_layers",
    "model.n_heads": "num_attention_heads",
    "model.n_kv_heads": "num_key_value_heads",
    "model.max_seq_len": "max_position_embeddings",
    "model.rope_theta": "rope_theta",
    "model.norm_eps": "rms_norm_eps",
    "model.init_std": "initializer_range",
    "model.moe.num_experts": "num_experts",
    "model.moe.top_k": "num_experts_per_tok",
    "model.moe.expert_hidden": "intermediate_size",
    "model.moe.lb_loss_weight": "router_aux_loss_coef",
}


def _is_kind(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or null")
    if kind.startswith("integer"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":  # JSON has no NaN or Infinity, but Python's json module reads them
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "bool":
        return isinstance(value, bool)
    return isinstance(value, Mapping)  # "object or null"


def hf_setting(hf: Mapping[str, Any], key: str, source: str = "config.json") -> Any:
    """One typed config.json setting (its default when absent); refused by file and key when missing or mistyped."""
    kind, default = ("integer", None) if key in _HF_REQUIRED_INTS else _HF_OPTIONAL[key]
    if key not in hf:
        if key in _HF_REQUIRED_INTS:
            raise ConversionError(f"{source}: {key} is missing (an OLMoE config.json sets it)")
        return default
    value = hf[key]
    if not _is_kind(value, kind):
        raise ConversionError(f"{source}: {key} must be {'an' if kind[0] in 'io' else 'a'} {kind}, got {type(value).__name__} {value!r}")
    return value


def _check_rope(hf: Mapping[str, Any], source: str) -> float:
    """rope_theta of a config with default RoPE (the only kind our model has)."""
    rope = hf_setting(hf, "rope_parameters", source) or {}
    scaling = hf_setting(hf, "rope_scaling", source) or {}
    for key, settings in (("rope_parameters", rope), ("rope_scaling", scaling)):
        kind = settings.get("rope_type", settings.get("type"))
        if kind not in (None, "default"):
            raise ConversionError(f"{source}: {key} has rope_type {kind!r}; only default RoPE is supported")
    theta = rope.get("rope_theta", hf_setting(hf, "rope_theta", source))
    if not _is_kind(theta, "number"):
        raise ConversionError(f"{source}: rope_parameters.rope_theta must be a number, got {type(theta).__name__} {theta!r}")
    return float(theta)


def model_config_from_hf(hf: Any, source: str = "config.json") -> ModelConfig:
    """Our ModelConfig for an HF OLMoE config.json mapping; every problem named by file and key."""
    if not isinstance(hf, Mapping):
        raise ConversionError(f"{source}: expected a JSON object of settings, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type != "olmoe":
        raise ConversionError(f"{source}: model_type is {model_type!r}, not 'olmoe'; only OLMoE checkpoints convert")
    check_hf_settings(hf, source)
    setting = lambda key: hf_setting(hf, key, source)  # noqa: E731
    theta = _check_rope(hf, source)
    data = {
        "vocab_size": setting("vocab_size"),
        "d_model": setting("hidden_size"),
        "n_layers": setting("num_hidden_layers"),
        "n_heads": setting("num_attention_heads"),
        "n_kv_heads": setting("num_key_value_heads"),
        "max_seq_len": setting("max_position_embeddings"),
        "rope_theta": theta,
        "norm_eps": float(setting("rms_norm_eps")),
        "qk_norm": True,
        "tie_embeddings": setting("tie_word_embeddings"),
        "init_std": float(setting("initializer_range")),
        "moe": {
            "num_experts": setting("num_experts"),
            "top_k": setting("num_experts_per_tok"),
            "expert_hidden": setting("intermediate_size"),
            "normalize_top_k": setting("norm_topk_prob"),
            "lb_loss_weight": float(setting("router_aux_loss_coef")),
        },
    }
    if data["n_kv_heads"] == data["n_heads"]:
        data["n_kv_heads"] = None
    try:
        return ModelConfig.from_dict(data, prefix="model").validate("model")
    except ConfigError as exc:  # a range or combination error: name the file's key, and ours
        ours, _, why = str(exc).partition(": ")
        key = f"{_HF_KEY_OF[ours]} ({ours})" if ours in _HF_KEY_OF else ours
        raise ConversionError(f"{source}: {key}: {why}") from None


# ------------------------------------------------------------------ tensor names and shapes

_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d{1,9})\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # transformers v5's layout


def _hf_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A layer's tensors other than the experts (OLMoE's QK-norm spans the whole q and k projections)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (q,),
        "self_attn.k_norm.weight": (kv,),
        "mlp.gate.weight": (cfg.moe.num_experts, d),
    }


def hf_tensor_shape(cfg: ModelConfig, name: str, source: str = "checkpoint") -> tuple[int, ...] | None:
    """The shape config.json implies for one HF OLMoE tensor (None: a buffer transformers recomputes);
    refused by name when the tensor has no place in this model (an unknown name, a layer or expert past the config's)."""
    d, hidden, n_exp = cfg.d_model, cfg.moe.expert_hidden, cfg.moe.num_experts
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, d)
    if name == "model.norm.weight":
        return (d,)
    if name.endswith("rotary_emb.inv_freq"):
        return None
    m = _HF_LAYER.match(name)
    if m and int(m.group(1)) >= cfg.n_layers:
        raise ConversionError(f"{source}: tensor {name}: layer {m.group(1)} does not exist (config.json num_hidden_layers={cfg.n_layers})")
    rest, layer_shapes = (m.group(2) if m else ""), _hf_layer_shapes(cfg)
    if rest in layer_shapes:
        return layer_shapes[rest]
    if em := _HF_EXPERT.match(rest):
        if int(em.group(1)) >= n_exp:
            raise ConversionError(f"{source}: tensor {name}: expert {em.group(1)} does not exist (config.json num_experts={n_exp})")
        return (d, hidden) if em.group(2) == "down_proj" else (hidden, d)
    if rest in _HF_FUSED:
        return (n_exp, d, hidden) if rest.endswith("down_proj") else (n_exp, 2 * hidden, d)
    raise ConversionError(f"{source}: tensor {name} has no counterpart in our OLMoE model")


def _first_missing(cfg: ModelConfig, names: frozenset[str] | set[str]) -> str | None:
    """The first tensor the config needs that ``names`` lacks. Stops at the first gap, so its work is
    bounded by len(names) even when config.json claims a billion layers or experts."""
    top = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    for name in top:
        if name not in names:
            return name
    for i in range(cfg.n_layers):
        prefix = f"model.layers.{i}."
        for rest in _hf_layer_shapes(cfg):
            if prefix + rest not in names:
                return prefix + rest
        if any(prefix + f in names for f in _HF_FUSED):
            wanted = (prefix + f for f in _HF_FUSED)
        else:
            wanted = (f"{prefix}mlp.experts.{e}.{kind}.weight" for e in range(cfg.moe.num_experts) for kind in ("gate_proj", "up_proj", "down_proj"))
        for name in wanted:
            if name not in names:
                return name
    return None


def check_hf_tensors(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str = "checkpoint") -> None:
    """Every tensor name and shape of an HF OLMoE checkpoint against its config.json: nothing unknown,
    nothing extra, nothing missing, one expert layout per layer, every shape the config's."""
    fused_layers, per_expert_layers = set(), set()
    for name, shape in shapes.items():
        want = hf_tensor_shape(cfg, name, source)
        if want is not None and tuple(shape) != want:
            raise ConversionError(f"{source}: tensor {name} has shape {tuple(shape)}, config.json says {want}")
        if (m := _HF_LAYER.match(name)) and m.group(2) in _HF_FUSED:
            fused_layers.add(int(m.group(1)))
        elif m and _HF_EXPERT.match(m.group(2)):
            per_expert_layers.add(int(m.group(1)))
    if both := fused_layers & per_expert_layers:
        raise ConversionError(
            f"{source}: model.layers.{min(both)} holds both the fused (mlp.experts.gate_up_proj) and the "
            "per-expert expert tensors; a checkpoint has one layout"
        )
    missing = _first_missing(cfg, set(shapes))
    if missing:
        raise ConversionError(f"{source}: tensor {missing} is missing")


def check_tied_lm_head(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """With tie_word_embeddings, a separate lm_head.weight is dropped: only if it is the embedding."""
    head, embed = hf_state.get("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
    if cfg.tie_embeddings and head is not None and embed is not None and not torch.equal(head.float(), embed.float()):
        raise ConversionError(
            f"{source}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight; "
            "refusing to drop it (set tie_word_embeddings to false to keep both)"
        )


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
                    raise ConversionError(f"{name}: cannot convert to Hugging Face OLMoE: it has no expert selection bias")
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
            elif em := _HF_EXPERT.match(rest):
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
    check_tied_lm_head(cfg, hf_state, source)
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    elif "lm_head.weight" not in out and "embed.weight" in out:
        raise ConversionError(f"{source}: lm_head.weight is missing and tie_word_embeddings is false")
    return out
