"""Convert stage: our DCP checkpoint <-> a Hugging Face OLMoE directory.

To HF: config.json, safetensors shards (with an index when sharded), tokenizer files and
generation_config.json, loadable by ``AutoModelForCausalLM.from_pretrained`` as
``OlmoeForCausalLM`` with no custom code. From HF: a weights-only DCP checkpoint to continue
training from (``checkpoint.init_from``). Both write to a temporary directory and rename.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from moe.config import ExperimentConfig, ModelConfig
from moe.interop import ConversionError, check_expressible, from_hf, hf_config, model_config_from_hf, to_hf
from moe.model import Transformer
from moe.train.checkpoint import CheckpointManager, load_tensors, read_meta, resolve_checkpoint
from moe.train.state import expert_param_layout, full_model_targets, split_experts
from pipeline.errors import PipelineError
from pipeline.outputs import check_own_output, replace_own_output
from pipeline.tokenizer import TokenizerInfo, load_tokenizer, write_hf_tokenizer_files

MARKER = "moe_conversion.json"  # marks a directory as our conversion output (replaceable)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Names and shapes of the tensors a checkpoint holds for this model (no memory used)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    persistent = set(model.state_dict().keys())
    shapes = {n: p.shape for n, p in model.named_parameters()}
    shapes.update({n: b.shape for n, b in model.named_buffers() if n in persistent})
    return shapes


def expert_names(cfg: ModelConfig) -> dict[str, int]:
    with torch.device("meta"):
        model = Transformer(cfg)
    return {n: total for n, (_, total) in expert_param_layout(model).items()}


def load_checkpoint_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Full fp32 weights by parameter name, whatever layout wrote the checkpoint."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"]["model"]).validate("model")
    full, targets = full_model_targets(model_shapes(cfg), expert_names(cfg))
    load_tensors(ckpt, {"model": targets})
    return cfg, full, meta


def _write_shards(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _atomic_dir(out: Path) -> Path:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _commit_dir(tmp: Path, out: Path) -> None:
    replace_own_output(tmp, out, MARKER, "convert.output (--out)")


def convert_to_hf(checkpoint: str | Path, out: str | Path, tokenizer: TokenizerInfo | None, *, dtype: str = "float32",
                  max_shard_bytes: int = 2_000_000_000) -> dict[str, Any]:
    out = Path(out)
    check_own_output(out, MARKER, "convert.output (--out)")  # before any work
    cfg, state, meta = load_checkpoint_weights(checkpoint)
    check_expressible(cfg)
    hf_state = {k: v.to(DTYPES[dtype]) for k, v in to_hf(cfg, state).items()}
    eos = tokenizer.eos_id if tokenizer else 0
    pad = tokenizer.pad_id if tokenizer else None
    tmp = _atomic_dir(out)
    try:
        _write_shards(hf_state, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, eos_id=eos, pad_id=pad, dtype=dtype), indent=2) + "\n")
        gen = {"eos_token_id": eos, "pad_token_id": pad if pad is not None else eos, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer:
            write_hf_tokenizer_files(tokenizer, tmp, cfg.max_seq_len)
        provenance = {
            "checkpoint": str(resolve_checkpoint(checkpoint)),
            "step": meta.get("step"),
            "tokenizer_sha256": tokenizer.sha256 if tokenizer else None,
            "dtype": dtype,
        }
        (tmp / MARKER).write_text(json.dumps(provenance, indent=2) + "\n")
        _commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return provenance


def read_hf_state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise PipelineError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(directory / f)))
        except Exception as exc:
            raise PipelineError(f"{directory / f}: unreadable safetensors file ({exc})") from None
    return state


def convert_from_hf(hf_dir: str | Path, out: str | Path) -> ModelConfig:
    hf_dir, out = Path(hf_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PipelineError(f"{out}: already exists and is not an empty directory; refusing to write a checkpoint there")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise PipelineError(f"{hf_dir}: no config.json; not a Hugging Face model directory")
    try:
        hf_cfg = json.loads(config_path.read_text())
    except ValueError as exc:
        raise PipelineError(f"{config_path}: not valid JSON ({exc})") from None
    cfg = model_config_from_hf(hf_cfg, str(config_path))
    ours = {k: v.float() for k, v in from_hf(cfg, read_hf_state(hf_dir), str(hf_dir)).items()}
    expected = model_shapes(cfg)
    for name, shape in expected.items():
        if name not in ours:
            if name.endswith("expert_bias"):
                continue
            raise ConversionError(f"{hf_dir}: tensor for {name} is missing")
        if ours[name].shape != shape:
            raise ConversionError(f"{hf_dir}: {name} has shape {tuple(ours[name].shape)}, config says {tuple(shape)}")
    extra = set(ours) - set(expected)
    if extra:
        raise ConversionError(f"{hf_dir}: unexpected tensor {sorted(extra)[0]}")
    meta = {"config": ExperimentConfig(model=cfg).to_dict(), "source": str(hf_dir), "weights_only": True}
    experts = expert_names(cfg)
    entries: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        entries.update(split_experts(name, t, 0) if name in experts else {name: t})
    CheckpointManager(out).save(0, {"model": entries}, meta, {})
    return cfg


def load_tokens_tokenizer(tokens_dir: str | Path) -> TokenizerInfo | None:
    path = Path(tokens_dir) / "tokenizer.json"
    return load_tokenizer(path) if path.is_file() else None
