"""Where each resolved value came from (the user, the recipe, the model preset, or the
dataclass default), and the one warning a recipe gives when the model outgrew it.

Worked out from the data as written (before expansion), so nothing is stored in the config:
a key the user sets wins, then the recipe's, then the model preset's (``model.*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.config.presets import model_preset
from moe.config.recipes import SCALE_KEYS, flat_keys, recipe, recipe_suits


def _effective_preset(raw: Mapping[str, Any]) -> str | None:
    model = raw.get("model") if isinstance(raw.get("model"), Mapping) else {}
    if "preset" in model:
        return model["preset"]
    name = raw.get("recipe")
    return recipe(name)["model"].get("preset") if name else None


def value_sources(raw: Mapping[str, Any]) -> dict[str, str]:
    """Dotted key -> "params" | "recipe NAME" | "preset NAME" for every key not left at its
    default (keys missing here keep the dataclass default)."""
    user = flat_keys({k: v for k, v in raw.items() if k != "recipe"})
    out = dict.fromkeys(user, "params")
    if raw.get("recipe"):
        out["recipe"] = "params"
        for k in flat_keys(recipe(raw["recipe"])):
            out.setdefault(k, f"recipe {raw['recipe']}")
    preset = _effective_preset(raw)
    if isinstance(preset, str):
        for k in flat_keys({"model": {k: v for k, v in model_preset(preset).items() if k != "preset"}}):
            out.setdefault(k, f"preset {preset}")
    return out


def recipe_overrides(raw: Mapping[str, Any], explicit: set[str] = frozenset()) -> str | None:
    """One line when the params file (not the command line: ``explicit``) sets a scale-bound
    key of the recipe to another value, e.g. the lr a `dvc exp run -S` left in params.yaml
    when the recipe is then switched (issue 36)."""
    name = raw.get("recipe")
    if not name:
        return None
    written = flat_keys({k: v for k, v in raw.items() if k != "recipe"})
    values = flat_keys(recipe(name))
    differ = [k for k in SCALE_KEYS if k in written and k in values and k not in explicit and written[k] != values[k]]
    if not differ:
        return None
    keys = ", ".join(f"{k}={written[k]} (recipe {name}: {values[k]})" for k in differ)
    return f"the params file sets {keys}: these win over the recipe; remove them from the params file to train with the recipe's"


def recipe_mismatch(raw: Mapping[str, Any]) -> str | None:
    """One line when the model preset is not one the recipe was made for and the recipe still
    supplies its scale-bound training values (the tiny recipe's lr on an OLMoE-width router)."""
    name = raw.get("recipe")
    preset = _effective_preset(raw)
    if not name or not isinstance(preset, str) or preset in recipe_suits(name):
        return None
    sources = value_sources(raw)
    inherited = [k for k in SCALE_KEYS if sources.get(k) == f"recipe {name}"]
    if not inherited:
        return None
    values = flat_keys(recipe(name))
    keys = ", ".join(f"{k}={values[k]}" for k in inherited)
    better = [r for r in ("olmoe-1b-7b", "paper-8l", "tiny") if preset in recipe_suits(r)]
    hint = f"recipe={better[0]}" if better else "a recipe for it"
    return (
        f"model.preset={preset} trains with recipe {name}'s {keys}, made for {', '.join(recipe_suits(name))}: "
        f"set {hint} (or these keys); a too-high lr collapses the router"
    )
