"""What a training run writes into its run directory and checkpoint directory, and the check
that a directory given as one holds nothing else (a user's folder is never written into).

The check reads what is there: every entry must be a name a run writes, not merely a marker.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from moe.train.checkpoint import STEP_DIR_NAME
from pipeline.errors import PipelineError

# The run directory: the job spec, its summary, metrics, logs, the lock, the tracking spool,
# the expert-load heatmap, and the temporary names they are written through.
RUN_DIR_NAMES = (
    "job.json",
    "summary.json",
    "metrics.jsonl",
    "logs",
    ".lock",
    "mlflow-fallback.jsonl",
    "mlflow-fallback.jsonl.synced",
    "expert_load.png",
    "eval",
    ".moe-outputs.json",
    ".*.tmp-*",
    "*.tmp",
    ".expert_load.png.*",
)
# The checkpoint directory: complete steps, the pointer to the newest, temporaries of saves.
CHECKPOINT_DIR_NAMES = ("latest", ".lock", ".tmp-step_*", ".tmp-old-step_*", ".latest.tmp-*")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _foreign_in_checkpoint_dir(root: Path) -> str | None:
    for p in sorted(root.iterdir()):
        if STEP_DIR_NAME.match(p.name) and p.is_dir() and not p.is_symlink():
            continue
        if not _matches(p.name, CHECKPOINT_DIR_NAMES) or (p.is_symlink() and p.name != "latest"):
            return p.name
    return None


def check_run_dirs(run_dir: str | Path, checkpoint_dir: str | Path) -> None:
    """Refuse a run or checkpoint directory that holds anything a training run does not write."""
    run, ckpt = Path(run_dir), Path(checkpoint_dir)
    for key, path in (("executor.run_dir", run), ("checkpoint.dir", ckpt)):
        if path.is_symlink() and not path.is_dir():
            raise PipelineError(f"{key}: {path} is a symlink to no directory")
    if ckpt.is_dir():
        foreign = _foreign_in_checkpoint_dir(ckpt)
        if foreign is not None:
            raise PipelineError(
                f"checkpoint.dir: {ckpt} holds {foreign}, which a training run does not write; "
                "refusing to write checkpoints there: choose another directory"
            )
    if not run.is_dir():
        return
    for p in sorted(run.iterdir()):
        if p.resolve() == ckpt.resolve() or _matches(p.name, RUN_DIR_NAMES) and not p.is_symlink():
            continue
        if p.is_dir() and not p.is_symlink() and _foreign_in_checkpoint_dir(p) is None:
            continue  # an earlier run's checkpoint directory (checkpoint.dir changed since)
        raise PipelineError(
            f"executor.run_dir: {run} holds {p.name}, which a training run does not write; refusing to write into it: choose another directory"
        )
