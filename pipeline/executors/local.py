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
import time
from pathlib import Path

from moe.parallel.env import free_port
from pipeline.executors.base import JobResult, TrainJob
from pipeline.outputs import open_for_write
from pipeline.run_dirs import LOG_HEADER
from pipeline.run_lock import RunLock, command_line

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
        port = free_port()
        procs: list[tuple[subprocess.Popen, Path]] = []
        threads = []
        for rank in range(job.nprocs):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(job.nprocs),
                "LOCAL_WORLD_SIZE": str(job.nprocs),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.nprocs))),
                "MOE_PARENT_PID": str(os.getpid()),  # pipeline.worker: die with us; we hold the run lock
            }
            log_path = logs / f"rank{rank}.log"
            log_file = open_for_write(log_path)  # refuses a symlink planted there, before anything starts
            log_file.write(f"{LOG_HEADER}: rank {rank} of {job.nprocs}\n")  # how a later run knows it is ours
            log_file.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.worker", str(spec)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            t = threading.Thread(target=_pump, args=(proc, log_file, rank == 0 and self.stream_rank0), daemon=True)
            t.start()
            procs.append((proc, log_path))
            forward.procs.append(proc)
            threads.append(t)
        failed: tuple[int, int, Path] | None = None
        while True:
            codes = [p.poll() for p, _ in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed is None:
                rank, code = bad[0]
                failed = (rank, code, procs[rank][1])
                _terminate([p for p, _ in procs])
            if all(c is not None for c in codes):
                break
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=5)
        if forward.signum is not None:
            name = signal.Signals(forward.signum).name
            return JobResult(
                False,
                128 + forward.signum,
                str(procs[0][1]),
                f"interrupted by {name}: the workers were stopped; rerun to resume from the last checkpoint",
            )
        if failed:
            rank, code, log_path = failed
            detail = last_error_line(log_path)
            return JobResult(False, code, str(log_path), f"rank {rank} exited with code {code}" + (f": {detail}" if detail else ""))
        return JobResult(True, 0, str(procs[0][1]))


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

    def _handler(self, signum, frame) -> None:
        self.signum = signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def _pump(proc: subprocess.Popen, log_file, echo: bool) -> None:
    with log_file as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()


def _terminate(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
