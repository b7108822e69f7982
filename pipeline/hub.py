"""Hugging Face Hub model ids: what a model card may name as its base model (a local path is
not one); and what a Hugging Face directory's config.json may hold, for every reader of one."""

from __future__ import annotations

import re
from pathlib import Path

from moe.reader import Bool, FileFormatError, Int, Map, Nullable, Num, Plain, Str, read_json

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")

_SIZE = Int(0, 2**31 - 1)
# An HF config.json: the settings convert reads typed and bounded (moe.interop.model_config_from_hf
# then says which are missing and which our model cannot express, by name); the many other keys
# transformers writes are free-form by design, bounded in depth and size.
HF_CONFIG_SCHEMA = Map(
    optional={
        "model_type": Str(128),
        "_name_or_path": Nullable(Str(4096)),
        **dict.fromkeys(
            ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_experts", "num_experts_per_tok"),
            _SIZE,
        ),
        "num_key_value_heads": Nullable(_SIZE),
        "max_position_embeddings": _SIZE,
        "rope_theta": Num(0, 1e12),
        "rms_norm_eps": Num(0, 1),
        "initializer_range": Num(0, 10),
        "router_aux_loss_coef": Num(0, 1e3),
        "tie_word_embeddings": Bool(),
        "norm_topk_prob": Bool(),
        "rope_parameters": Nullable(Map(other=Plain(), max_keys=64)),
        "rope_scaling": Nullable(Map(other=Plain(), max_keys=64)),
    },
    other=Plain(max_depth=16),
    max_keys=1000,
)
MAX_HF_CONFIG_BYTES = 4 << 20  # transformers writes a few kB


def hub_id(value: object) -> str | None:
    """``value`` if it is a Hub model id ("org/name"), else None (a local path is not one)."""
    if isinstance(value, str) and HUB_ID.fullmatch(value) and ".." not in value and not value.endswith(".git"):
        return value
    return None


# A Hub repository name: ``name`` or ``owner/name``, each part as the Hub accepts it
# (huggingface_hub's validate_repo_id: letters, digits, ``-``, ``_``, ``.``; at most 96).
HUB_NAME = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def hub_name(value: object) -> str | None:
    """``value`` if the Hub would take it as a model repository's name (with or without its
    owner), else None."""
    if not isinstance(value, str) or not HUB_NAME.fullmatch(value) or "--" in value or ".." in value:
        return None
    return None if value.endswith((".git", "-", ".")) else value


def source_model_id(hf_dir: Path) -> str | None:
    """The Hub id an HF directory's config.json names as its origin (``_name_or_path``), if any:
    not when that names a directory here (a model saved from a local copy records its path)."""
    try:
        named = hub_id(read_json(hf_dir / "config.json", HF_CONFIG_SCHEMA, MAX_HF_CONFIG_BYTES).get("_name_or_path"))
    except FileFormatError:
        return None
    if named is None or Path(named).exists() or (hf_dir.parent / named).exists():
        return None
    return named
