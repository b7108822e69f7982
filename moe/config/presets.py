"""Named model shapes: the paper's reference models and small shapes for CPUs.

A preset is a plain mapping; ``model: {preset: olmoe-1b-7b, moe: {num_experts: 32}}`` starts
from it and overrides on top.

``paper-8l`` is the paper's 8-layer DDP-vs-FSDP benchmark model. paper.md gives d_model 4096,
64 experts of hidden 4096, top-4, and 3.17B active / 24.31B total parameters; 8 -> 128 experts
gives 4.6B -> 47B total. Those four figures come out exactly (to the digits given) with one
dense first layer of hidden 32768 and seven MoE layers, a 100352-token vocabulary (dolma2,
padded) and untied embeddings; that is our reconstruction, pinned by tests/config/test_presets.py.
"""

from __future__ import annotations

from typing import Any

from moe.config.base import unknown_name_error

_PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: trains in seconds on a laptop CPU.
    "tiny": {
        "vocab_size": 512,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 1024,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 64},
    },
    # allenai/OLMoE-1B-7B-0924: 6.9B total, 1.3B active.
    "olmoe-1b-7b": {
        "vocab_size": 50304,
        "d_model": 2048,
        "n_layers": 16,
        "n_heads": 16,
        "max_seq_len": 4096,
        "rope_theta": 10000.0,
        "qk_norm": True,
        "tie_embeddings": False,
        "moe": {
            "num_experts": 64,
            "top_k": 8,
            "expert_hidden": 1024,
            "score_func": "softmax",
            "normalize_top_k": False,
            "lb_loss_weight": 0.01,
            "z_loss_weight": 0.001,
        },
    },
    "paper-8l": {
        "vocab_size": 100352,
        "d_model": 4096,
        "n_layers": 8,
        "n_heads": 32,
        "max_seq_len": 8192,
        "rope_theta": 500000.0,
        "qk_norm": True,
        "tie_embeddings": False,
        "dense_layers": [0],
        "dense_hidden": 32768,
        "moe": {
            "num_experts": 64,
            "top_k": 4,
            "expert_hidden": 4096,
            "score_func": "softmax",
            "lb_loss_weight": 0.01,
            "z_loss_weight": 0.001,
        },
    },
}

# The paper's expert sweep at fixed top-4 (constant active parameters).
for _e in (8, 16, 32, 64, 128):
    _PRESETS[f"paper-8l-e{_e}"] = {**_PRESETS["paper-8l"], "moe": {**_PRESETS["paper-8l"]["moe"], "num_experts": _e}}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def model_preset(name: str, key: str = "model.preset") -> dict[str, Any]:
    try:
        preset = _PRESETS[name]
    except KeyError:
        raise unknown_name_error(key, "preset", name, _PRESETS) from None
    return {**_copy(preset), "preset": name}


def _copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return list(data)
    return data
