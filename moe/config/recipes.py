"""Training recipes: the optimizer, schedule, batch, sequence length and loss weights that go
with a model, beside the model presets (which give only its shape).

``recipe: olmoe-1b-7b`` at the top of a config fills every key below that the config does not
set itself; explicit keys win, as with model presets. A recipe names the model preset it was
made for (``model.preset``, itself overridable) and the presets it suits (``suits``): a model
preset outside them trained with the recipe's optimizer values gets one warning line naming
the keys (``recipe_mismatch``), since the tiny model's learning rate collapses an OLMoE-width
router.

Where each value comes from:

- ``tiny``: the embedded CPU default (the values params.yaml carried before recipes).
- ``olmoe-1b-7b``: Olmo-core's ``src/scripts/train/OLMoE-1B-7B.py`` (allenai/OLMo-core main
  fa6c5014, unchanged since 601d336): AdamW lr 4e-4, betas (0.9, 0.95), eps 1e-8, weight decay
  0.1 with none on the embeddings, ``CosWithWarmup(warmup_steps=2000)`` (alpha_f 0.1: the lr
  ends at 4e-5), global batch 1024 x 4096 tokens, rank micro-batch 2 sequences, max grad norm
  1.0, ``z_loss_multiplier=1e-5`` on the output logits, and the model's MoE losses
  (lb 0.01, router z 0.001). That script sets RoPE theta 500,000; the published
  allenai/OLMoE-1B-7B-0924 (and our preset, which continues it) uses 10,000.
- ``paper-8l``: the paper's 8-layer benchmark model. Its training script is not public; the
  values are those of Olmo-core's closest public script for that shape
  (``olmo-ddp:src/scripts/train/OLMoE3-dev-260623-testrun.py`` @3067db14: 8 layers, d 4096,
  expert hidden 4096, top-4, sequence 8192, 128 sequences per step, lr 3e-4 scaled by
  (batch / 4M tokens)^0.53 = 1.44e-4, warm-up over 5B tokens = 4768 steps at 1M tokens,
  cosine to 0.1, weight decay 0.1, betas (0.9, 0.95), clip 1.0, logit z-loss 1e-5,
  lb 0.01, router z 0.001).
"""

from __future__ import annotations

from typing import Any

from moe.config.base import ConfigError, unknown_name_error

_RECIPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "suits": ["tiny"],
        "model": {"preset": "tiny", "moe": {"lb_loss_weight": 0.01, "z_loss_weight": 0.001}},
        "optim": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "decay_embeddings": False},
        "schedule": {"warmup_steps": 20, "decay": "cosine", "min_lr_ratio": 0.1},
        "data": {"seq_len": 128},
        "train": {"global_batch_size": 16, "micro_batch_size": 8, "grad_clip": 1.0, "logit_z_loss_weight": 0.0},
    },
    "olmoe-1b-7b": {
        "suits": ["olmoe-1b-7b"],
        "model": {"preset": "olmoe-1b-7b", "moe": {"lb_loss_weight": 0.01, "z_loss_weight": 0.001}},
        "optim": {"lr": 4e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "decay_embeddings": False},
        "schedule": {"warmup_steps": 2000, "decay": "cosine", "min_lr_ratio": 0.1},
        "data": {"seq_len": 4096},
        "train": {"global_batch_size": 1024, "micro_batch_size": 2, "grad_clip": 1.0, "logit_z_loss_weight": 1e-5},
    },
    "paper-8l": {
        "suits": ["paper-8l", "paper-8l-e8", "paper-8l-e16", "paper-8l-e32", "paper-8l-e64", "paper-8l-e128"],
        "model": {"preset": "paper-8l", "moe": {"lb_loss_weight": 0.01, "z_loss_weight": 0.001}},
        "optim": {"lr": 1.44e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "decay_embeddings": False},
        "schedule": {"warmup_steps": 4768, "decay": "cosine", "min_lr_ratio": 0.1},
        "data": {"seq_len": 8192},
        "train": {"global_batch_size": 128, "micro_batch_size": 2, "grad_clip": 1.0, "logit_z_loss_weight": 1e-5},
    },
}

# The keys whose recipe value is a training choice tied to the model's scale: a preset the
# recipe was not made for gets a warning when these came from the recipe.
SCALE_KEYS = ("optim.lr", "schedule.warmup_steps", "train.global_batch_size", "data.seq_len")


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def recipe(name: str, key: str = "recipe") -> dict[str, Any]:
    """The recipe's sections (a fresh copy), without its ``suits`` list."""
    if not isinstance(name, str):
        raise ConfigError(f"{key}: expected a recipe name, got {name!r}")
    try:
        found = _RECIPES[name]
    except KeyError:
        raise unknown_name_error(key, "recipe", name, _RECIPES) from None
    return _copy({k: v for k, v in found.items() if k != "suits"})


def recipe_suits(name: str) -> list[str]:
    return list(_RECIPES[name]["suits"])


def flat_keys(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> {"a.b.c": value} (lists are values)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_keys(v, key + "."))
        else:
            out[key] = v
    return out


def _copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return list(data)
    return data
