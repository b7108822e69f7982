"""Convert stage: our DCP checkpoint <-> a Hugging Face OLMoE directory.

To HF: config.json, safetensors shards (with an index when sharded), tokenizer files and
generation_config.json, loadable by ``AutoModelForCausalLM.from_pretrained`` as
``OlmoeForCausalLM`` with no custom code. From HF: a weights-only DCP checkpoint to continue
training from (``checkpoint.init_from``). Both write to a temporary directory and rename.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe.config import ExperimentConfig, ModelConfig
from moe.interop import (
    ConversionError,
    check_expressible,
    check_hf_tensors,
    check_tied_lm_head,
    from_hf,
    hf_config,
    model_config_from_hf,
    to_hf,
)
from moe.reader import FileFormatError, Int, Map, Nullable, Plain, Spec, Str, read_json
from moe.train.checkpoint import CheckpointError, CheckpointManager, read_meta, resolve_checkpoint
from moe.train.state import split_experts
from moe.train.weights import expert_names, load_checkpoint_weights, model_shapes
from pipeline.errors import PipelineError
from pipeline.hub import HF_CONFIG_SCHEMA, MAX_HF_CONFIG_BYTES, source_model_id
from pipeline.outputs import SHA256_HEX, WRITTEN_FILES, check_own_output, fresh_temp_dir, inside, replace_own_output, seal_output, write_atomic
from pipeline.stage_spec import Output, Stage
from pipeline.tokenizer import TokenizerInfo, load_tokenizer, write_hf_tokenizer_files

MARKER = "moe_conversion.json"  # marks a directory as our conversion output (replaceable)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The conversion record (convert_to_hf's provenance, sealed with the files it wrote), as the
# release stage reads it back.
CONVERSION_RECORD_SCHEMA = Map(
    required={"checkpoint": Str(4096), "written_files": WRITTEN_FILES},
    optional={
        "step": Nullable(Int(0)),
        "tokenizer_sha256": Nullable(SHA256_HEX),
        "dtype": Str(choices=tuple(DTYPES)),
    },
)


def trained_checkpoint(checkpoint: str | Path) -> Path:
    """The checkpoint a stage after training reads; where there is none yet, the error says
    what makes one."""
    try:
        return resolve_checkpoint(checkpoint)
    except CheckpointError as exc:
        if not str(exc).endswith("no complete checkpoint found"):
            raise
        raise CheckpointError(f"{exc}: train first (`moe train`, or `dvc repro` for the whole pipeline)") from None


def check_checkpoint_tokenizer(checkpoint: str | Path, tokenizer: TokenizerInfo, tokenizer_file: str | Path | None = None) -> None:
    """A checkpoint meets only the tokenizer it was trained with (its meta.json's data.tokenizer_hash,
    when it records one: a conversion from HF does not), and never one with more tokens than its
    embedding has rows."""
    ckpt = trained_checkpoint(checkpoint)
    config = read_meta(ckpt).get("config") or {}
    recorded = (config.get("data") or {}).get("tokenizer_hash")
    vocab_size = ModelConfig.from_dict(config.get("model")).vocab_size
    named = tokenizer_file or "the tokenizer (tokenize.output)"
    if tokenizer.vocab_size > vocab_size:
        raise PipelineError(
            f"{named}: {tokenizer.vocab_size} tokens, more than the checkpoint's model.vocab_size={vocab_size} ({ckpt / 'meta.json'})"
        )
    if recorded is not None and recorded != tokenizer.sha256:
        raise PipelineError(
            f"{named}: tokenizer {tokenizer.sha256[:12]} is not the one {ckpt} was trained with "
            f"({ckpt / 'meta.json'}: data.tokenizer_hash {str(recorded)[:12]})"
        )


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
    return fresh_temp_dir(out)  # a new name: never someone's folder


def _commit_dir(tmp: Path, out: Path) -> None:
    replace_own_output(tmp, out, MARKER, "convert.output (--out)")


def convert_to_hf(
    checkpoint: str | Path,
    out: str | Path,
    tokenizer: TokenizerInfo | None,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 2_000_000_000,
    tokenizer_file: str | Path | None = None,
    card: Callable[[ModelConfig, dict[str, Any]], str] | None = None,
) -> dict[str, Any]:
    """Our checkpoint -> a Hugging Face OLMoE directory at ``out``; ``card(model config, meta)``
    gives its README.md (the model card)."""
    out = Path(out)
    check_own_output(out, MARKER, "convert.output (--out)")  # before any work
    checkpoint = trained_checkpoint(checkpoint)
    if tokenizer:
        check_checkpoint_tokenizer(checkpoint, tokenizer, tokenizer_file)
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
        if card is not None:
            write_atomic(tmp / "README.md", card(cfg, meta))
        provenance = {
            "checkpoint": str(resolve_checkpoint(checkpoint)),
            "step": meta.get("step"),
            "tokenizer_sha256": tokenizer.sha256 if tokenizer else None,
            "dtype": dtype,
        }
        seal_output(tmp, MARKER, provenance)  # lists every file: proof of what we wrote
        _commit_dir(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(exc):
            raise PipelineError(
                f"{out}: cannot write the converted model: no space left on the device ({_first_line(exc)}); nothing was written"
            ) from None
        raise
    return provenance


def _disk_full(exc: BaseException) -> bool:
    """ENOSPC, from Python's own writes or as text from safetensors' Rust writer."""
    import errno

    return (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left on device" in str(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# Weights we read: floating point that every layer of ours computes in (safetensors' dtype codes).
HF_WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_OTHER_DTYPES = {
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}  # only to name them in the error
INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class HfDirectory:
    """An HF OLMoE directory whose config.json and safetensors headers passed every check (no tensor read yet)."""

    path: Path
    cfg: ModelConfig
    shards: dict[str, list[str]]  # file name -> the tensors it holds


def file_inside(directory: Path, name: Any, named_by: str) -> Path:
    """``directory/name``: a file that stays inside ``directory`` (pipeline.outputs.inside: no
    ``../``, no absolute path, no symlink out): a hostile directory must not make us read someone
    else's files."""
    path = inside(directory, name, named_by)
    if not path.is_file():
        raise PipelineError(f"{path}: not found or not a file (named by {named_by})")
    return path


# model.safetensors.index.json (transformers' and _write_shards'): tensor name -> the shard holding it
# (each file name then taken only through file_inside), and free-form metadata (total_size).
HF_INDEX_SCHEMA = Map(
    required={"weight_map": Map(other=Str(4096), keys=Str(1024), max_keys=1_000_000)},
    optional={"metadata": Map(other=Plain(max_depth=8), max_keys=1000)},
)
MAX_HF_INDEX_BYTES = 64 << 20


def read_json_file(path: Path, schema: Spec, max_bytes: int) -> Any:
    """A JSON file of an HF directory, checked against ``schema`` (one error naming file and field)."""
    try:
        return read_json(path, schema, max_bytes)
    except FileFormatError as exc:
        raise PipelineError(str(exc)) from None


def read_hf_config(directory: Path) -> ModelConfig:
    if not (directory / "config.json").exists():
        raise PipelineError(f"{directory}: no config.json; not a Hugging Face model directory")
    path = file_inside(directory, "config.json", str(directory))
    return model_config_from_hf(read_json_file(path, HF_CONFIG_SCHEMA, MAX_HF_CONFIG_BYTES), str(path))


def shard_names(directory: Path) -> dict[str, str] | list[str]:
    """The index's weight_map (tensor -> file), or the one file of an unsharded checkpoint."""
    single = directory / "model.safetensors"
    has_single = single.exists() or single.is_symlink()
    if has_single and (directory / INDEX).exists():  # transformers would load the one, we would check the other
        raise PipelineError(f"{directory}: holds both model.safetensors and {INDEX}; a checkpoint has one or the other")
    if (directory / INDEX).exists():
        path = file_inside(directory, INDEX, str(directory))
        weight_map = read_json_file(path, HF_INDEX_SCHEMA, MAX_HF_INDEX_BYTES)["weight_map"]
        if not weight_map:
            raise PipelineError(f"{path}: weight_map must be a non-empty object of tensor name -> file name")
        for name, file in weight_map.items():
            file_inside(directory, file, f"{path}: weight_map[{name!r}]")
        return weight_map
    if has_single:
        file_inside(directory, "model.safetensors", str(directory))
        return ["model.safetensors"]
    raise PipelineError(f"{directory}: no model.safetensors or {INDEX}")


def read_headers(directory: Path, files: list[str]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """tensor name -> (file, dtype code, shape), from the safetensors headers alone."""
    from safetensors import SafetensorError, safe_open

    headers: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(directory / file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                    part = f.get_slice(name)
                    if name in headers:
                        raise PipelineError(f"{directory}: tensor {name} is in both {headers[name][0]} and {file}")
                    headers[name] = (file, part.get_dtype(), tuple(part.get_shape()))
        except SafetensorError as exc:
            raise PipelineError(f"{directory / file}: unreadable safetensors file ({exc})") from None
    return headers


def open_hf_dir(directory: str | Path) -> HfDirectory:
    """Check an HF OLMoE directory without reading its weights: config.json's keys and types, every
    shard a file inside the directory, the index matching the shards, and every tensor's name, shape
    and dtype against the config."""
    directory = Path(directory)
    cfg = read_hf_config(directory)
    names = shard_names(directory)
    files = sorted(set(names.values())) if isinstance(names, dict) else names
    headers = read_headers(directory, files)
    if isinstance(names, dict):
        for name, (file, _, _) in headers.items():
            if names.get(name) != file:
                raise PipelineError(f"{directory / INDEX}: its weight_map puts tensor {name} in {names.get(name)}, but {file} holds it")
        if unlisted := sorted(set(names) - set(headers)):
            raise PipelineError(f"{directory / INDEX}: weight_map names tensor {unlisted[0]}, which no shard holds")
    for name, (file, dtype, _) in headers.items():
        if dtype not in HF_WEIGHT_DTYPES:
            raise ConversionError(
                f"{directory / file}: tensor {name} is {_OTHER_DTYPES.get(dtype, dtype)}; weights must be {', '.join(HF_WEIGHT_DTYPES.values())}"
            )
    check_hf_tensors(cfg, {name: shape for name, (_, _, shape) in headers.items()}, str(directory))
    shards: dict[str, list[str]] = {f: [] for f in files}
    for name, (file, _, _) in headers.items():
        shards[file].append(name)
    return HfDirectory(directory, cfg, shards)


def load_hf_weights(hf: HfDirectory, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor, one at a time, each refused by name unless finite; a tied lm_head.weight only
    if it is the embedding. ``keep=False`` checks them without holding them (nothing returned)."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file, names in hf.shards.items():
        with safe_open(str(hf.path / file), framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if not bool(torch.isfinite(t).all()):
                    raise ConversionError(f"{hf.path / file}: tensor {name} holds NaN or infinite values")
                if keep or name in ("model.embed_tokens.weight", "lm_head.weight"):
                    state[name] = t
    check_tied_lm_head(hf.cfg, state, str(hf.path))
    return state if keep else {}


def check_hf_dir(directory: str | Path) -> ModelConfig:
    """The one validator of an HF OLMoE directory (config, tensor names, shapes, dtypes, values), for
    `moe convert --from-hf` and before `moe evaluate` hands a directory to transformers (whose
    from_pretrained would initialise a missing tensor at random and say nothing)."""
    hf = open_hf_dir(directory)
    load_hf_weights(hf, keep=False)
    return hf.cfg


def convert_from_hf(hf_dir: str | Path, out: str | Path) -> ModelConfig:
    hf_dir, out = Path(hf_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PipelineError(f"{out}: already exists and is not an empty directory; refusing to write a checkpoint there")
    hf = open_hf_dir(hf_dir)
    cfg = hf.cfg
    ours = {k: v.float() for k, v in from_hf(cfg, load_hf_weights(hf), str(hf_dir)).items()}
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
    meta = {"config": ExperimentConfig(model=cfg).to_dict(), "source": str(hf_dir), "source_model": source_model_id(hf_dir), "weights_only": True}
    experts = expert_names(cfg)
    entries: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        entries.update(split_experts(name, t, 0) if name in experts else {name: t})
    CheckpointManager(out).save(0, {"model": entries}, meta, {})
    return cfg


def load_tokens_tokenizer(tokens_dir: str | Path) -> TokenizerInfo | None:
    path = Path(tokens_dir) / "tokenizer.json"
    return load_tokenizer(path) if path.is_file() else None


# What dvc.yaml runs, reads and writes for this stage, and the code it runs (pipeline/stage_spec.py).
STAGE = Stage(
    name="convert",
    params=("convert",),
    deps=("runs/train", "data/tokens"),
    outputs=(Output("runs/hf", MARKER),),
    code=("pipeline/stages/convert.py", "moe/interop", "pipeline/errors.py", "pipeline/hub.py", "pipeline/outputs.py", "pipeline/tokenizer.py"),
)
