"""Resume, extend, or refuse when the train stage runs where checkpoints already are.

The run directory is a ``persist: true`` output in dvc.yaml, so DVC no longer deletes the
checkpoints before rerunning the stage: an interrupted ``dvc repro`` resumes where it stopped.
Whether the checkpoints belong to the run asked for now is decided by comparing the
training-relevant config stored in the newest checkpoint's meta.json (model, optimiser,
schedule, data, steps, seeds, precision; not the layout, which checkpoints are independent
of, nor checkpoint/log cadence) with the config asked for:

- the same: resume;
- only ``train.max_steps`` differs and lies beyond the checkpoint: continue (extend) from the
  checkpoint, the schedule following the curve of the new length (stated in one line);
- anything else: a checkpoint is never deleted to start afresh. The stage refuses, naming the
  keys that differ and how to start afresh, unless every file of those checkpoints is stored
  in the project's DVC cache (a finished ``dvc repro`` committed them; ``dvc checkout`` brings
  them back), in which case the working copies are removed and training starts afresh.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from moe.reader import FileFormatError, read_text
from moe.train.checkpoint import META, STEP_DIR_NAME, CheckpointError, latest_checkpoint, list_checkpoints, read_meta
from pipeline.errors import PipelineError

log = logging.getLogger("pipeline.resume")
LATEST_MAX_BYTES = 256  # "step_00001000\n", as moe.train.checkpoint reads it

# Keys that do not change what a run computes.
NOT_HASHED = {
    "checkpoint": {"dir", "every", "keep_last", "resume", "init_from", "save", "asynchronous"},
    "train": {
        "log_every",
        "peak_tflops",
        "device",
        "eval_every",
        "eval_tasks",
        "eval_limit",
        "eval_seed",
        "eval_truncation",
        "eval_val_batches",
        "eval_batch_tokens",
        "load_alarm",
        "router_health",
    },
    "parallel": None,  # checkpoints are layout-independent (tested); None: the whole section
    "recipe": None,  # a label: its values are in the other sections
}
MODEL_LABELS = ("preset", "preset_overrides")  # how the config was written, not what it is


def _relevant(config: dict[str, Any]) -> dict[str, Any]:
    relevant = {}
    for section, values in sorted(config.items()):
        skip = NOT_HASHED.get(section, set())
        if skip is None:
            continue
        if section == "model" and isinstance(values, dict):
            values = {k: v for k, v in values.items() if k not in MODEL_LABELS}
        relevant[section] = {k: v for k, v in values.items() if k not in skip} if isinstance(values, dict) else values
    return relevant


def differing_keys(saved: dict[str, Any], config: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted training-relevant keys whose values differ: key -> (there, here)."""
    out: dict[str, tuple[Any, Any]] = {}

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        elif a != b:
            out[prefix] = (a, b)

    walk(_relevant(saved), _relevant(config), "")
    return out


def prepare_checkpoints(config: dict[str, Any], act: bool = True) -> str:
    """'fresh' (nothing there), 'resume', 'extend' (a longer max_steps) or 'restart' (the
    checkpoints of another config were in the DVC cache and are removed here); raises
    PipelineError instead of deleting a checkpoint that is not stored anywhere else.
    ``act=False``: decide (and refuse) only; nothing is removed or said."""
    root = Path(config["checkpoint"]["dir"])
    try:
        latest = latest_checkpoint(root)
    except CheckpointError as exc:
        raise PipelineError(str(exc)) from None
    if latest is None or config["checkpoint"].get("resume") == "never":
        return "fresh"  # with resume=never the trainer refuses a directory that holds checkpoints
    saved = read_meta(latest).get("config", {})
    diffs = differing_keys(saved, config)
    step = int(read_meta(latest)["step"])
    init_from = config["checkpoint"].get("init_from")
    if not diffs:
        if act:
            log.info("resuming from %s (same training config)", latest)
        return "resume"
    if set(diffs) == {"train.max_steps"} and config["train"]["max_steps"] > step:
        _say(extension_note(saved, config, step))  # a statement, not a change: said when deciding too
        return "extend"
    if init_from and _inside(Path(init_from), root):
        raise PipelineError(
            f"checkpoint.init_from: {init_from} lies inside checkpoint.dir={root}, which holds checkpoints of another "
            f"training config ({_describe(diffs)}); set checkpoint.dir (and executor.run_dir) to a new directory to "
            "start a run from it"
        )
    if stored_in_dvc_cache(root):
        if not act:
            return "restart"
        removed = remove_own_checkpoints(root)
        _say(
            f"{root} held checkpoints of another training config ({_describe(diffs)}), all stored in the DVC cache "
            f"(`dvc checkout` restores them): removed {removed} working copies, starting afresh"
        )
        return "restart"
    beyond = f"; its checkpoint is at step {step}, beyond train.max_steps={config['train']['max_steps']}" if set(diffs) == {"train.max_steps"} else ""
    raise PipelineError(
        f"checkpoint.dir: {root} holds checkpoints of another training config ({_describe(diffs)}){beyond}. "
        "Nothing was deleted. To continue them, use their config; to start afresh, set checkpoint.dir and "
        f"executor.run_dir to new directories (or move {root} away)"
    )


def continued_run_id(config: dict[str, Any], run_dir: str | Path) -> str | None:
    """The MLflow run of the training that this one continues (resume or extend: the
    checkpoints are this config's), as the run directory's job.json recorded it; None when the
    run starts afresh, or no run was recorded. Decided as prepare_checkpoints decides, without a
    word or a change: its continuation's metrics join the same curve."""
    from pipeline.tracking.spool import OFFLINE_PREFIX
    from pipeline.train_job import TrainJob

    root = Path(config["checkpoint"]["dir"])
    try:
        latest = latest_checkpoint(root)
        if latest is None or config["checkpoint"].get("resume") == "never":
            return None
        meta = read_meta(latest)
        diffs = differing_keys(meta.get("config", {}), config)
        if diffs and not (set(diffs) == {"train.max_steps"} and config["train"]["max_steps"] > int(meta["step"])):
            return None
        run_id = TrainJob.read(Path(run_dir) / "job.json").mlflow_run_id
    except (CheckpointError, PipelineError, FileFormatError, KeyError, TypeError, ValueError):
        return None  # prepare_checkpoints names what is wrong; a new run is made meanwhile
    return run_id if run_id and not run_id.startswith(OFFLINE_PREFIX) else None


def extension_note(saved: dict[str, Any], config: dict[str, Any], step: int) -> str:
    """The line that states how an extended run's learning rate goes on."""
    from moe.config import ScheduleConfig
    from moe.optim import lr_lambda

    schedule = ScheduleConfig.from_dict(config["schedule"])
    lr = float(config["optim"]["lr"])
    old, new = saved["train"]["max_steps"], config["train"]["max_steps"]
    before = lr * lr_lambda(ScheduleConfig.from_dict(saved["schedule"]), old)(step - 1)
    after = lr * lr_lambda(schedule, new)(step)
    return (
        f"extending the run from train.max_steps={old} to {new}: continuing from the checkpoint at step {step}; "
        f"the {schedule.decay} schedule now runs over {new} steps (lr {after:.3g} at step {step + 1}, "
        f"was {before:.3g} at step {step})"
    )


def _say(line: str) -> None:
    """One line on the stage's console (and the log): how the run starts is the user's business."""
    log.info("%s", line)
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _describe(diffs: dict[str, tuple[Any, Any]], limit: int = 3) -> str:
    parts = [f"{k}={a!r} there, {b!r} here" for k, (a, b) in list(diffs.items())[:limit]]
    more = len(diffs) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


# ------------------------------------------------------------------ the DVC cache


def dvc_cache_dir(start: Path) -> Path | None:
    """The DVC cache of the project ``start`` lies in (None outside a DVC project)."""
    from pipeline.project import project_root

    root = project_root(start)
    if not (root / ".dvc").is_dir():
        return None
    try:
        r = subprocess.run([sys.executable, "-m", "dvc", "cache", "dir"], cwd=root, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = r.stdout.strip().splitlines()
    return Path(lines[-1]) if r.returncode == 0 and lines else None


def _md5(path: Path) -> str:
    h = hashlib.md5()  # noqa: S324 - DVC's content address, not a security hash
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def stored_in_dvc_cache(root: Path) -> bool:
    """Every file of every checkpoint under ``root`` is in the DVC cache with the same content."""
    cache = dvc_cache_dir(root)
    if cache is None:
        return False
    steps = list_checkpoints(root)
    files = [f for s in steps for f in s.rglob("*") if f.is_file()]
    for f in files:
        digest = _md5(f)
        obj = cache / "files" / "md5" / digest[:2] / digest[2:]
        if not obj.is_file() or obj.stat().st_size != f.stat().st_size:
            return False
    return bool(files)


def remove_own_checkpoints(root: Path) -> int:
    """Remove the step directories (each exactly the files its meta.json lists) and ``latest``."""
    removed = 0
    for p in sorted(root.iterdir()):
        if STEP_DIR_NAME.match(p.name) and p.is_dir() and not p.is_symlink():
            listed = set(read_meta(p)["files"]) | {META}
            present = {f.name for f in p.iterdir()}
            if present != listed or any(f.is_dir() or f.is_symlink() for f in p.iterdir()):
                raise PipelineError(f"{p}: holds files its meta.json does not list; refusing to remove it")
            shutil.rmtree(p)
            removed += 1
    latest = root / "latest"
    if not latest.is_symlink() and STEP_DIR_NAME.match(_pointer_text(latest)):
        latest.unlink()
    return removed


def _pointer_text(latest: Path) -> str:
    """What ``latest`` names (as the checkpointer writes it: a step directory's name), or ""
    where it is absent or not a small text file (then it is not ours to remove)."""
    try:
        return read_text(latest, LATEST_MAX_BYTES).strip()
    except FileFormatError:
        return ""
