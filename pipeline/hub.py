"""Hugging Face Hub model ids: what a model card may name as its base model (a local path is
not one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def hub_id(value: object) -> str | None:
    """``value`` if it is a Hub model id ("org/name"), else None (a local path is not one)."""
    if isinstance(value, str) and HUB_ID.fullmatch(value) and ".." not in value and not value.endswith(".git"):
        return value
    return None


def source_model_id(hf_dir: Path) -> str | None:
    """The Hub id an HF directory's config.json names as its origin (``_name_or_path``), if any:
    not when that names a directory here (a model saved from a local copy records its path)."""
    try:
        named = hub_id(json.loads((hf_dir / "config.json").read_text()).get("_name_or_path"))
    except (OSError, ValueError, AttributeError):
        return None
    if named is None or Path(named).exists() or (hf_dir.parent / named).exists():
        return None
    return named
