"""A model's full weights from a checkpoint, whatever parallel layout wrote it: for conversion,
evaluation and anything else that needs the model rather than the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moe.config import ModelConfig
from moe.errors import CheckpointError
from moe.layers.experts import expert_param_layout
from moe.model import Transformer
from moe.train.checkpoint import load_tensors, read_meta, resolve_checkpoint
from moe.train.state import full_model_targets


def model_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Names and shapes of the tensors a checkpoint holds for this model (no memory used)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    persistent = set(model.state_dict().keys())
    shapes = {n: p.shape for n, p in model.named_parameters()}
    shapes.update({n: b.shape for n, b in model.named_buffers() if n in persistent})
    return shapes


def expert_names(cfg: ModelConfig) -> dict[str, int]:
    """Stacked expert weights of the model -> the number of experts (saved one per key)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {n: total for n, (_, total) in expert_param_layout(model).items()}


def load_checkpoint_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(model config, full fp32 weights by parameter name, meta.json) of a checkpoint."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"]["model"]).validate("model")
    full, targets = full_model_targets(model_shapes(cfg), expert_names(cfg))
    load_tensors(ckpt, {"model": targets})
    return cfg, full, meta


def load_model(checkpoint: str | Path, device: torch.device) -> Transformer:
    """The checkpoint's model on ``device``, in eval mode."""
    cfg, state, _ = load_checkpoint_weights(checkpoint)
    with torch.device(device):
        model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()
