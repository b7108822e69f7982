"""What a training run writes into its run directory and checkpoint directory, and the check
that a directory given as one holds nothing else (a user's folder is never written into).

The check reads what is there: every entry must be a name a run writes, the files a run
rewrites (its job spec, summary, metrics, logs, lock) must read as ours, and a folder holding
anything but the lock must carry the run's record, the ``job.json`` every executor writes
before anything else: a user's folder that happens to hold a ``summary.json``, a
``logs/rank0.log`` or a ``metrics.jsonl`` of step rows of its own is refused, not overwritten.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from pathlib import Path

from moe.eval.requests import is_requests_file
from moe.reader import MIB, FileFormatError, Int, Map, Nullable, Plain, Str, parse_json, read_bytes, read_json
from moe.train.sinks import METRIC_ROW, METRICS_MAX_BYTES
from pipeline.errors import PipelineError

# The run directory: the job spec, its summary, metrics, logs, the lock, the tracking spool,
# the expert-load heatmap, the in-loop tasks tokenised (pipeline.eval.inloop) and the output
# ledger those two are entered in (pipeline.outputs).
RUN_RECORD = "job.json"  # written by every executor before the job starts: what makes a folder a run's
RUN_DIR_NAMES = (
    RUN_RECORD,
    "summary.json",
    "metrics.jsonl",
    "logs",
    ".lock",
    "mlflow-fallback.jsonl",
    "mlflow-fallback.jsonl.synced",
    "expert_load.png",
    "eval_requests.json.gz",
    ".moe-outputs.json",
)
# The temporaries those are written through (pipeline.outputs.write_atomic and the metrics
# sink: ``.<name>.tmp-*``), and the fixed one of versions before (read as metrics below).
RUN_DIR_TEMPORARIES = (
    *(f".{name}.tmp-*" for name in (RUN_RECORD, "summary.json", "metrics.jsonl", "expert_load.png", "eval_requests.json.gz", ".moe-outputs.json")),
    "metrics.jsonl.tmp",
)
NEEDS_NO_RECORD = (".lock",)  # the lock is taken before the record is written
# The checkpoint directory: complete steps, the pointer to the newest, temporaries of saves.
CHECKPOINT_DIR_NAMES = ("latest", ".lock", ".tmp-step_*", ".tmp-old-step_*", ".latest.tmp-*")


# The first line of every worker log (pipeline.executors.local writes it): how a run knows its own logs.
LOG_HEADER = "# moe worker log"
_LOG_NAME = re.compile(r"rank\d+\.log")
_JSON_LIMIT = 64 * MIB  # a job spec or summary larger than this is not one of ours
_SCAN = MIB  # metrics.jsonl: the lines of the first and the last MiB are checked
LOCK_MAX_BYTES = 4096
# The .lock's holder as pipeline.run_lock writes it (emptied when released).
LOCK_HOLDER_SCHEMA = Map(
    required={
        "pid": Int(1, 2**31 - 1),
        "host": Str(255),
        "command": Str(4096),
        "slurm_job_id": Nullable(Str(64)),  # $SLURM_JOB_ID as the environment had it
        "since": Str(64, r"[0-9T:+.-]+"),
    }
)


def _json_object(path: Path) -> dict | None:
    try:
        data = read_json(path, Plain(), _JSON_LIMIT)
    except FileFormatError:
        return None
    return data if isinstance(data, dict) else None


def is_job_spec(path: Path) -> bool:
    """A job spec we wrote (``moe`` job.json): the TrainJob's fields and nothing else."""
    return _is_job_spec(path)


def _is_job_spec(path: Path) -> bool:
    from pipeline.train_job import TrainJob

    data = _json_object(path)
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    return data is not None and {"config", "run_dir"} <= data.keys() <= fields and isinstance(data["config"], dict)


def _is_summary(path: Path) -> bool:
    from pipeline.worker import SUMMARY_SCHEMA

    try:
        read_json(path, SUMMARY_SCHEMA, _JSON_LIMIT)
    except FileFormatError:
        return False
    return True


def _metric_row(line: bytes) -> bool | None:
    """True: a metrics row (moe.train.sinks.METRIC_ROW); False: JSON that is not one; None: not
    JSON at all (a line a crash tore)."""
    try:
        row = parse_json(line.decode("utf-8"), "a metrics line")
    except (UnicodeDecodeError, FileFormatError):
        return None
    try:
        METRIC_ROW.check(row)
    except FileFormatError:
        return False
    return True


def _is_metrics(path: Path) -> bool:
    """Every JSON line checked (all of a small file; the first and last MiB of a large one) is a
    metrics row, and at least one is (an empty file holds nothing to lose). Lines that are not
    JSON at all (a write torn by a crash) are tolerated: the readers skip them with a warning."""
    try:
        data = read_bytes(path, METRICS_MAX_BYTES)
    except FileFormatError:
        return False
    # a large file: the first and the last MiB, less the lines the cuts split
    lines = data.split(b"\n") if len(data) <= 2 * _SCAN else data[:_SCAN].split(b"\n")[:-1] + data[-_SCAN:].split(b"\n")[1:]
    kinds = [_metric_row(line) for line in lines if line.strip()]
    return not kinds or (False not in kinds and True in kinds)


def _is_log_dir(path: Path) -> bool:
    for entry in path.iterdir():
        if not _LOG_NAME.fullmatch(entry.name) or entry.is_symlink() or not entry.is_file():
            return False
        with open(entry, "rb") as f:
            start = f.read(len(LOG_HEADER))
        if start and start != LOG_HEADER.encode():  # (an empty log holds nothing to lose)
            return False
    return True


def _is_lock(path: Path) -> bool:
    """Empty (released) or naming its holder as pipeline.run_lock writes it."""
    if path.is_symlink():
        return False
    try:
        text = read_bytes(path, LOCK_MAX_BYTES).decode("utf-8").strip()
        if text:
            LOCK_HOLDER_SCHEMA.check(parse_json(text, str(path)), f"{path}: ")
    except (UnicodeDecodeError, FileFormatError):
        return False
    return True


# Entries whose content is checked (the rest are written only through the output ledger, or
# are directories of our own whose names are checked).
_CONTENT = {
    "job.json": _is_job_spec,
    "summary.json": _is_summary,
    "metrics.jsonl": _is_metrics,
    "metrics.jsonl.tmp": _is_metrics,
    "logs": _is_log_dir,
    ".lock": _is_lock,
    "eval_requests.json.gz": is_requests_file,
}


def _not_ours(p: Path) -> bool:
    check = _CONTENT.get(p.name)
    if check is None:
        return False
    if p.name == "logs":
        return not p.is_dir() or not check(p)
    return not p.is_file() or not check(p)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _foreign_in_checkpoint_dir(root: Path) -> str | None:
    from moe.train.checkpoint import STEP_DIR_NAME  # (imports torch: not before a config is valid)

    for p in sorted(root.iterdir()):
        if STEP_DIR_NAME.match(p.name) and p.is_dir() and not p.is_symlink():
            continue
        if not _matches(p.name, CHECKPOINT_DIR_NAMES) or (p.is_symlink() and p.name != "latest"):
            return p.name
    return None


def check_run_dirs(run_dir: str | Path, checkpoint_dir: str | Path, also: tuple[str, ...] = ()) -> None:
    """Refuse a run or checkpoint directory that holds anything a training run does not write
    (``also``: names a caller's own runs add, e.g. the paper pipeline's marker)."""
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
    if run.is_dir():
        _check_run_dir(run, ckpt, also)


def _check_run_dir(run: Path, ckpt: Path, also: tuple[str, ...]) -> None:
    """Every entry is one a run writes and reads as ours; and the folder carries the run's
    record (its job.json, or the caller's marker) unless it holds only what is there before
    the record is written (the lock, the checkpoint directory)."""
    unrecorded = None  # the first entry that only a run directory with its record may hold
    for p in sorted(run.iterdir()):
        if p.resolve() == ckpt.resolve() or (p.name in also and p.is_file() and not p.is_symlink()):
            continue
        _check_run_entry(run, p)
        if unrecorded is None and p.name not in NEEDS_NO_RECORD:
            unrecorded = p.name
    records = [run / name for name in (RUN_RECORD, *also)]  # a caller's marker is its runs' record
    if unrecorded is not None and not any(r.is_file() and not r.is_symlink() for r in records):
        raise PipelineError(
            f"executor.run_dir: {run} holds {unrecorded} but no {RUN_RECORD}, the record every training run writes first: "
            "it is not a run directory; refusing to write into it: choose another directory"
        )


def _check_run_entry(run: Path, p: Path) -> None:
    """``p`` is a name a run writes whose content reads as ours, or an earlier run's checkpoint
    directory (checkpoint.dir changed since)."""
    if _matches(p.name, RUN_DIR_NAMES + RUN_DIR_TEMPORARIES) and not p.is_symlink():
        if _not_ours(p):
            hint = f" (a run directory of a version before worker logs began with {LOG_HEADER!r}: remove its logs/)" if p.name == "logs" else ""
            raise PipelineError(
                f"executor.run_dir: {run} holds {p.name}, whose content is not what a training run writes there; "
                f"refusing to overwrite it: choose another directory{hint}"
            )
        return
    if p.is_dir() and not p.is_symlink() and _foreign_in_checkpoint_dir(p) is None:
        return
    raise PipelineError(
        f"executor.run_dir: {run} holds {p.name}, which a training run does not write; refusing to write into it: choose another directory"
    )
