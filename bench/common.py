"""Timing and result recording shared by the benchmarks.

Timing: CUDA events around each run, warm-up first, median of many runs; inputs are random
(never zeros) and outputs are checked against each other before anything is timed.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe.switches import set_in_environment

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    if os.environ.get("MOE_GIT_COMMIT"):
        return os.environ["MOE_GIT_COMMIT"]
    here = Path(__file__).parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=here).stdout.strip()
        # a copied working tree (the accelerator machine's) can differ from the commit its git metadata names
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        changed = subprocess.run(status, capture_output=True, text=True, check=True, cwd=here).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}+dirty" if changed.strip() else sha


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "git_commit": git_commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        # the library's switches (moe.switches) this process ran with (the side-by-sides of bench/h200), or None
        "switches": set_in_environment(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    else:
        env["device"] = "cpu"
    return env


def time_cuda(fn: Callable[[], Any], *, warmup: int = 5, iters: int = 30, before: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median/min/max milliseconds of ``fn`` over ``iters`` runs (CUDA events per run)."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


def timed_train_steps(trainer, steps: int) -> list[float]:
    """Seconds of each of ``steps`` library training steps (CUDA events, synchronised per step;
    the trainer's step counter advances as in ``fit``)."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        trainer.train_step()
        end.record()
        trainer.step += 1
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def pipelined_train_steps(trainer, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps run back to back as ``Trainer.fit`` runs them
    between log points: an event between steps and one synchronisation at the end, so the host
    prepares step i+1 while the GPU runs step i. ``timed_train_steps`` synchronises after every
    step and so also counts the host's time to the step's first kernel; the difference is what a
    step costs the host that training hides."""
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for i in range(steps):
        trainer.train_step()
        trainer.step += 1
        marks[i + 1].record()
    torch.cuda.synchronize()
    return [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)]


def kernel_overlap(prof) -> dict[str, float]:
    """From a torch.profiler trace: milliseconds of communication kernels (NCCL), of everything
    else, and of communication with no other kernel running (what the step waits for)."""

    def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[list[float]] = []
        for a, b in sorted(intervals):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]

    comm, compute = [], []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        span = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else compute).append(span)
    comm_u, compute_u = union(comm), union(compute)
    exposed = 0.0
    for a, b in comm_u:  # comm time not covered by any compute interval
        covered = 0.0
        for c, d in compute_u:
            if d <= a:
                continue
            if c >= b:
                break
            covered += min(b, d) - max(a, c)
        exposed += (b - a) - covered
    return {"comm_ms": sum(b - a for a, b in comm_u) / 1e3, "compute_ms": sum(b - a for a, b in compute_u) / 1e3, "exposed_comm_ms": exposed / 1e3}


def matmul_peak_tflops(n: int = 8192, iters: int = 20) -> float:
    """Measured bf16 dense matmul ceiling on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda: a @ b, warmup=3, iters=iters)
    return 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def write_result(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    device = payload.get("environment", {}).get("device", "cpu").replace(" ", "-")
    path = out_dir / f"{name}-{device}-{stamp}.json"
    path.write_text(json.dumps(_finite_or_null(payload), indent=2, sort_keys=True, allow_nan=False) + "\n")
    return path


def _finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinity (a variant not timed, a ratio of nothing) as None:
    the file stays JSON that any reader takes (NaN is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def save_result(name: str, payload: dict[str, Any], save: bool = True, out_dir: Path | None = None) -> Path | None:
    """``write_result`` and say where it went (nothing when ``save`` is False: --no-save)."""
    if not save:
        return None
    path = write_result(name, payload, out_dir)
    print(f"wrote {path}")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)
