"""The harness of the hostile-input tables (tests/pipeline/test_hostile*.py).

Each case runs a real `moe` command (in-process through typer's runner, or as a subprocess with
a deadline for cases that could hang) or a library call against a private copy of a trained
workspace, and is classified:

    clear     non-zero exit with one `error:` line (or the expected exception), nothing else broken
    ok        the fault was absorbed as documented (exit 0, e.g. spooled metrics, a loud skip)
    traceback an unexpected exception or a traceback in the output
    silent    exit 0 / no error where one was due
    lost      a file we did not create, or a valid output, was deleted or changed
    leaked    a planted password appeared in output or files
    executed  planted code ran
    hang      the command did not end within its deadline

Every table module registers its rows in RESULTS; the session prints one table per module and
the counts (conftest.py's terminal summary).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moe.parallel.env import free_port
from tests.helpers import Planted, plant_pickle, reseal  # noqa: F401 - re-exported for the tables
from tests.workspace import REPO  # noqa: E402

SECRET = "hunter2-s3cret"
OUTCOMES = ("clear", "ok", "traceback", "silent", "lost", "leaked", "executed", "hang")
RESULTS: dict[str, dict[str, tuple[str, str]]] = {}  # table -> case id -> (outcome, detail)


@dataclasses.dataclass
class Case:
    id: str
    item: int
    args: list[str] | None = None  # `moe` arguments
    call: Callable | None = None  # or a library-level case: call(ws) asserts what must happen
    setup: Callable | None = None  # setup(ws) before the command
    expect: str = "clear"
    check: Callable | None = None  # check(ws, result) -> outcome override or None
    env: dict | None = None
    slow: bool = False
    # Run as `python -m pipeline.cli ...` in a fresh process, killed after `timeout` s ("hang").
    subprocess: bool = False
    timeout: float = 120.0
    keep: tuple[str, ...] = ()  # workspace files (globs) that must be unchanged after the case (else "lost")
    teardown: Callable | None = None  # teardown(ws) after the case, whatever happened


@dataclasses.dataclass
class Result:
    """What check() callbacks get: like typer's result, for in-process and subprocess runs."""

    exit_code: int
    output: str
    exception: BaseException | None = None


# ----------------------------------------------------------------------------- planting
# Planted, plant_pickle and reseal live in tests/helpers.py (the library tests use them too).


def ckpt(ws: Path) -> Path:
    from moe.train.checkpoint import latest_checkpoint

    return latest_checkpoint(ws / "runs/train/checkpoints")


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def user_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("my notes\n")


def sentinel_files(ws: Path) -> list[Path]:
    return [p for p in ws.rglob("notes.txt")] + [p for p in ws.rglob("precious*")]


def _snapshot(ws: Path, patterns: tuple[str, ...]) -> dict[Path, str]:
    out = {}
    for pattern in patterns:
        for p in ws.glob(pattern):
            if p.is_file() and not p.is_symlink():
                out[p] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _app():
    from pipeline.cli import app

    return app


# -------------------------------------------------------------------------- running


def _classify(case: Case, ws: Path, result: Result, before: list[Path], kept: dict[Path, str]) -> str:
    out = result.output
    lost = [p for p in before if not p.exists()]
    changed = [p for p, h in kept.items() if not p.is_file() or hashlib.sha256(p.read_bytes()).hexdigest() != h]
    if (ws / "injected").exists() or (ws / "EXECUTED").exists() or "\ntouch injected" in out:
        return "executed"
    if lost or changed:
        return "lost"
    if SECRET in out:
        return "leaked"
    if re.search(r"weights[ _]only(=| set to | argument)", out, re.IGNORECASE):  # torch's advice to load unsafely, passed on
        return "traceback"
    if (result.exception is not None and not isinstance(result.exception, SystemExit)) or "Traceback" in out:
        return "traceback"
    if result.exit_code == 0:
        return "ok" if case.expect == "ok" else "silent"
    lines = out.strip().splitlines()
    # the command's own last line (a training run streams rank 0's log above it)
    return "clear" if lines and lines[-1].startswith("error:") and result.exit_code != 1 else "traceback"


def run_cli(case: Case, ws: Path) -> tuple[str, str]:
    if case.setup:
        case.setup(ws)
    before = sentinel_files(ws)
    kept = _snapshot(ws, case.keep)
    if case.subprocess:
        result = _run_subprocess(case, ws)
        if result is None:
            return "hang", f"no exit within {case.timeout:.0f}s"
    else:
        r = CliRunner().invoke(_app(), case.args, catch_exceptions=True)
        result = Result(r.exit_code, r.output, r.exception)
    outcome = _classify(case, ws, result, before, kept)
    if case.check and outcome in ("ok", "clear", "silent"):
        outcome = case.check(ws, result) or outcome
    out = result.output.strip()
    return outcome, out.splitlines()[-1] if out else ""


def _run_subprocess(case: Case, ws: Path) -> Result | None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *case.args],
        cwd=ws,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=case.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return Result(proc.returncode, out)


def run_call(case: Case, ws: Path) -> tuple[str, str]:
    if case.setup:
        case.setup(ws)
    kept = _snapshot(ws, case.keep)
    try:
        case.call(ws)
    except (AssertionError, pytest.fail.Exception) as exc:
        return "silent", (str(exc).splitlines() or ["assertion"])[0]
    except Exception as exc:  # an unexpected exception is a finding
        return "traceback", f"{type(exc).__name__}: {exc}"
    if (ws / "EXECUTED").exists():
        return "executed", ""
    if any(not p.is_file() or hashlib.sha256(p.read_bytes()).hexdigest() != h for p, h in kept.items()):
        return "lost", ""
    return ("ok" if case.expect == "ok" else "clear"), ""


def make_workspace(trained_dir: Path, tmp_path: Path, monkeypatch) -> Path:
    """A private copy of the shared trained workspace (tokens, checkpoints), as cwd."""
    root = tmp_path / "ws"
    shutil.copytree(trained_dir, root, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts", "mlruns"), symlinks=True)
    monkeypatch.chdir(root)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MOE_MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return root


def run_case(table: str, case: Case, ws: Path, monkeypatch) -> None:
    for k, v in (case.env or {}).items():
        monkeypatch.setenv(k, f"http://127.0.0.1:{free_port()}" if v == "unreachable" else v)
    started = time.monotonic()
    try:
        outcome, detail = run_call(case, ws) if case.call else run_cli(case, ws)
    finally:
        if case.teardown:
            case.teardown(ws)
    RESULTS.setdefault(table, {})[case.id] = (outcome, f"{time.monotonic() - started:5.1f}s {detail}")
    assert outcome == case.expect, f"{case.id}: {outcome} ({detail})"
    assert not (ws / "injected").exists() and not (ws / "EXECUTED").exists()


def params_for(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


def summary_lines() -> list[str]:
    lines = []
    total = {k: 0 for k in OUTCOMES}
    for table, rows in RESULTS.items():
        lines += ["", f"hostile-input cases ({table}):"]
        lines += [f"  {cid:46s} {o:9s} {d[:100]}" for cid, (o, d) in rows.items()]
        for o, _ in rows.values():
            total[o] = total.get(o, 0) + 1
    if RESULTS:
        tried = sum(len(r) for r in RESULTS.values())
        lines.append(
            "hostile-input totals: tried {} / clear {} / absorbed {} / traceback {} / silent {} / lost {} / leaked {} / executed {} / hang {}".format(
                tried, *(total[k] for k in OUTCOMES)
            )
        )
    return lines
