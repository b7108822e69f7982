"""Where metrics go. The library ships JSON-lines and console sinks; the pipeline adds MLflow."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Protocol

from moe.errors import DISK_ERRNOS, MoeError, OutputError
from moe.reader import MIB, AnyOf, FileFormatError, Int, Map, Nullable, Num, Str, parse_json, read_bytes

log = logging.getLogger("moe.train")

METRICS_MAX_BYTES = 4096 * MIB  # a long run of a wide model logs tens of kB per row
# A metrics.jsonl row as JsonlSink.log writes it: the step, then the trainer's figures, each a
# finite number or, when not finite, its text (str(float)); null (a missing figure) is accepted.
METRIC_ROW = Map(
    required={"step": Int(0, 10**12)},
    other=Nullable(AnyOf((Num(), Str(8, choices=("nan", "inf", "-inf"))), "a finite number, or nan, inf, -inf")),
    keys=Str(256, r"[A-Za-z0-9_.:/\-]+"),  # loss, eval/<task>/<metric>, expert_load/layer_<i>/expert_<e>, ...
)


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, summary: dict[str, Any]) -> None: ...


class JsonlSink:
    """One JSON object per log point, appended and flushed (survives a killed run).

    The file keeps the history of earlier attempts of the same run: on its first write, rows
    at or after the first step this attempt logs (steps re-run after a resume, or all of them
    on a rerun from scratch) and a line cut short by a kill are dropped; the rest stays."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._f = None  # opened on the first log: ranks that never log never touch the file

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}
        try:
            if self._f is None:
                self._f = self._open_from(step)
            self._f.write(json.dumps({"step": step, **clean}) + "\n")
            self._f.flush()
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            raise OutputError(f"{self.path}: cannot write the metrics of step {step} ({exc.strerror}{_free_note(self.path)})") from None

    def _open_from(self, step: int):
        check_output_target(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in _metric_lines(self.path) if _step_of(line) < step]
            write_file_atomic(self.path, "".join(line + "\n" for line in kept))
        return _open_for_append(self.path)

    def close(self, summary: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.close()


def _free_note(path: Path) -> str:
    try:
        return f"; {shutil.disk_usage(path.parent).free / 2**30:.2f} GiB free on its file system"
    except OSError:
        return ""


def check_output_target(path: Path, key: str | None = None) -> None:
    """Before anything is written: ``path`` is absent or a regular file, and its folder can be
    one. A symlink there would carry the write into whatever it points at (a user's file), and
    a directory or device is nobody's output; ``key`` (a flag) names the setting at fault."""
    where = f"{key}: {path}" if key else str(path)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # (NotADirectoryError: a file where its folder belongs)
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        raise MoeError(f"{where} is a symlink; refusing to write through it (remove it or choose another path)")
    if mode is not None and not stat.S_ISREG(mode):
        raise MoeError(f"{where} exists and is not a regular file; refusing to replace it")
    folder = next((p for p in Path(path).absolute().parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise MoeError(f"{where}: {folder} is not a directory")


def write_file_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fresh temporary in the same folder and a rename:
    the rename replaces a name instead of writing through a symlink, and a failure (a full
    disk) leaves the old file whole and no temporary behind."""
    check_output_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _open_for_append(path: Path):
    """Open for appending without following a symlink at ``path`` (one planted since the check)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        check_output_target(path)  # names a symlink planted since: one error line, not a traceback
        raise
    return os.fdopen(fd, "a")


def _metric_lines(path: Path) -> list[str]:
    """The lines of a metrics file (bounded, a regular file). Not strict UTF-8: a damaged line
    is one line to skip, not a reason to refuse the whole history."""
    return read_bytes(path, METRICS_MAX_BYTES).decode("utf-8", errors="replace").splitlines()


def parse_metric_row(line: str, where: str) -> dict[str, Any]:
    """One metrics.jsonl line checked against METRIC_ROW (FileFormatError names the field)."""
    return METRIC_ROW.check(parse_json(line, where), f"{where}: ")


def _step_of(line: str) -> float:
    """The step of a metrics line; inf (dropped) for a line that is not a whole metrics row."""
    try:
        return parse_metric_row(line, "a metrics line")["step"]
    except FileFormatError:
        return math.inf


class ConsoleSink:
    KEYS = ("loss", "lr", "grad_norm", "tokens_per_s_per_device", "tflops_per_device", "mfu")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "lr" not in metrics:
            return  # a loss-only entry between log points
        parts = [f"step {step}"]
        for k in self.KEYS:
            if k in metrics:
                v = metrics[k]
                parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        if "eta_s" in metrics:
            minutes, seconds = divmod(int(round(metrics["eta_s"])), 60)
            parts.append(f"eta={minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
        log.info("  ".join(parts))

    def close(self, summary: dict[str, Any]) -> None:
        return None


def read_metric_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of metrics.jsonl, one per step: a resumed job re-runs the steps after its last
    checkpoint, and the later row (the one the finished model descends from) wins. A damaged
    line (a kill mid-write, an edit) is skipped with one warning naming it, as the training
    sink itself drops it on the next resume."""
    by_step: dict[int, dict[str, Any]] = {}
    damaged: list[tuple[int, FileFormatError]] = []
    for lineno, line in enumerate(_metric_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = parse_metric_row(line, f"{path}: line {lineno}")
        except FileFormatError as exc:
            damaged.append((lineno, exc))
            continue
        by_step[row["step"]] = row
    if damaged:
        (lineno, exc), n = damaged[0], len(damaged)
        why = str(exc).removeprefix(f"{path}: line {lineno}: ")
        print(f"warning: {path}:{lineno}: skipped {n} damaged line(s) (not a metrics row; the first: {why})", file=sys.stderr, flush=True)
    return [by_step[s] for s in sorted(by_step)]
