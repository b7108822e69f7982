"""Local executor: one process, or N processes on this machine launched like torchrun.

The launching process holds the run directory's lock while its workers run, passes
SIGTERM/SIGINT/SIGHUP on to them, and takes them along when it dies (PDEATHSIG): killing
`moe train` never leaves a worker training on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from moe.parallel.spawn import start_ranks
from pipeline.executors.base import JobResult
from pipeline.outputs import open_for_write
from pipeline.run_dirs import LOG_HEADER
from pipeline.run_lock import RunLock, command_line
from pipeline.train_job import TrainJob

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def last_error_line(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    lines = [line for line in lines if not line.startswith(LOG_HEADER)]
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line:
            return line.strip()
    return lines[-1].strip() if lines else ""


class LocalExecutor:
    def __init__(self, stream_rank0: bool = True) -> None:
        self.stream_rank0 = stream_rank0

    def run(self, job: TrainJob) -> JobResult:
        lock = RunLock(job.run_dir, job.checkpoint_dir).acquire(f"{command_line()} (local executor)", reentrant=True)
        with lock, _ForwardSignals() as forward:
            return self._run(job, forward)

    def _run(self, job: TrainJob, forward: _ForwardSignals) -> JobResult:
        spec = job.write()
        logs = Path(job.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.nprocs))),
            "MOE_PARENT_PID": str(os.getpid()),  # pipeline.worker: die with us; we hold the run lock
        }
        log_paths = [logs / f"rank{rank}.log" for rank in range(job.nprocs)]
        ranks = start_ranks(
            [sys.executable, "-m", "pipeline.worker", str(spec)],
            job.nprocs,
            env=env,
            logs=log_paths,
            open_log=lambda rank, path: _open_log(path, rank, job.nprocs),
            echo=0 if self.stream_rank0 else None,
        )
        forward.adopt(ranks.procs)
        ranks.wait()
        if forward.signum is not None:
            name = signal.Signals(forward.signum).name
            return JobResult(
                False,
                128 + forward.signum,
                str(log_paths[0]),
                f"interrupted by {name}: the workers were stopped; rerun to resume from the last checkpoint",
            )
        if ranks.failure:
            rank, code, log_path = ranks.failure.rank, ranks.failure.exit_code, log_paths[ranks.failure.rank]
            detail = last_error_line(log_path)
            return JobResult(False, code, str(log_path), f"rank {rank} exited with code {code}" + (f": {detail}" if detail else ""))
        return JobResult(True, 0, str(log_paths[0]))


def _open_log(path: Path, rank: int, world: int):
    log_file = open_for_write(path)  # refuses a symlink planted there, before anything starts
    log_file.write(f"{LOG_HEADER}: rank {rank} of {world}\n")  # how a later run knows it is ours
    log_file.flush()
    return log_file


class _ForwardSignals:
    """While the workers run, a termination signal to this process goes to each of them too."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> _ForwardSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handler) for s in FORWARDED_SIGNALS}
        return self

    def adopt(self, procs: list[subprocess.Popen]) -> None:
        """Forward to ``procs`` from now on (and the signal that came while they started)."""
        self.procs.extend(procs)
        if self.signum is not None:
            self._handler(self.signum, None)

    def _handler(self, signum, frame) -> None:
        self.signum = signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
