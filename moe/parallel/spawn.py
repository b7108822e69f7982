"""N ranks of one job on this machine, started as torchrun would start them.

Every rank gets the rendezvous environment (MASTER_ADDR/MASTER_PORT on a free port, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and joins its process group from it. A rank is either
a command (``start_ranks``: a fresh interpreter each, e.g. the pipeline's worker) or a function
(``spawn_ranks``/``run_ranks``: ``fn(rank, world, *args)`` in processes started by
torch.multiprocessing's "spawn", so ``fn`` and ``args`` must pickle). Both give a ``RankGroup``,
which waits for the ranks, stops the others when one fails and says which rank failed, how, and
the end of what it wrote (its log, or its traceback).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from moe.parallel.env import free_port

LOOPBACK = "127.0.0.1"
TAIL_LINES = 20


def rendezvous_env(rank: int, world: int, port: int, addr: str = LOOPBACK) -> dict[str, str]:
    """What torchrun sets for one rank of a single-node job."""
    return {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
    }


@dataclasses.dataclass(frozen=True)
class RankFailure:
    rank: int
    exit_code: int
    tail: str = ""  # the last lines the rank wrote (its log) or its traceback

    def __str__(self) -> str:
        if self.exit_code < 0:
            try:
                how = f"was killed by {signal.Signals(-self.exit_code).name}"
            except ValueError:
                how = f"was killed by signal {-self.exit_code}"
        else:
            how = f"exited with code {self.exit_code}"
        return f"rank {self.rank} {how}" + (f"; the end of its output:\n{self.tail}" if self.tail else "")


class RanksFailed(RuntimeError):
    """A rank of a group ended with a non-zero exit code (the first one to, when several did)."""

    def __init__(self, failure: RankFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def tail(path: Path | None, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a text file ('' when there is none)."""
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


class _SpawnedProcess:
    """A multiprocessing.Process seen as a subprocess.Popen (poll, terminate, kill, pid)."""

    def __init__(self, process) -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        return self.process.exitcode


class RankGroup:
    """The processes of one job's ranks (rank order), and where each one's output went."""

    def __init__(self, procs: list, outputs: list[Path | None], pumps: Sequence[threading.Thread] = (), cleanup: Sequence[Path] = ()) -> None:
        self.procs, self.outputs, self._pumps, self._cleanup = procs, outputs, list(pumps), list(cleanup)
        self._failed: tuple[int, int] | None = None
        self._failure: RankFailure | None = None

    @property
    def world(self) -> int:
        return len(self.procs)

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float | None = None, stop_on_failure: bool = True, grace: float = 10.0, every: float = 0.1) -> list[int]:
        """Wait for every rank; returns their exit codes. When one fails, the others are stopped
        (SIGTERM, SIGKILL after ``grace`` seconds) unless ``stop_on_failure`` is False; those
        still running after ``timeout`` seconds are killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = self.poll()
            bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if bad and self._failed is None:
                self._failed = bad[0]
                if stop_on_failure:
                    self.terminate(grace)
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                continue
            time.sleep(every)
        for t in self._pumps:
            t.join(timeout=5)
        self._finish()
        return [int(c) for c in codes]

    def terminate(self, grace: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    @property
    def failure(self) -> RankFailure | None:
        """The first rank seen failing (after ``wait``): its rank, exit code and output's end."""
        if self._failure is None and self._failed is not None:
            rank, code = self._failed
            self._failure = RankFailure(rank, code, tail(self.outputs[rank]))
        return self._failure

    def check(self) -> None:
        """Raise RanksFailed when a rank failed."""
        if self.failure is not None:
            raise RanksFailed(self.failure)

    def _finish(self) -> None:
        """Read the failure before the scratch files (tracebacks of function ranks) go."""
        _ = self.failure
        for path in self._cleanup:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self._cleanup = []


# ------------------------------------------------------------------ commands


def start_ranks(
    argv: Sequence[str],
    world: int,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    logs: Sequence[Path] | None = None,
    open_log: Callable[[int, Path], IO[str]] | None = None,
    echo: int | None = None,
) -> RankGroup:
    """``argv`` once per rank, each with ``env`` (default: this process's environment) and its
    rendezvous variables. ``logs``: a file per rank taking its stdout and stderr (opened by
    ``open_log(rank, path)``, default ``open(path, "w")``, all before any rank starts); rank
    ``echo``'s lines are also copied to this process's stdout. Without logs the ranks write
    where this process does."""
    if logs is not None and len(logs) != world:
        raise ValueError(f"{len(logs)} log files for {world} ranks")
    base = dict(os.environ if env is None else env)
    port = free_port()
    files: list[IO[str] | None] = []
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for rank in range(world):  # every log opened (or refused) before any rank starts
            files.append((open_log or _open_log)(rank, logs[rank]) if logs is not None else None)
        for rank, log in enumerate(files):
            piped = log is not None and rank == echo
            out, err = (subprocess.PIPE if piped else log), (subprocess.STDOUT if log is not None else None)
            proc = subprocess.Popen(list(argv), cwd=cwd, env={**base, **rendezvous_env(rank, world, port)}, stdout=out, stderr=err, text=piped)
            procs.append(proc)
            if piped:
                pumps.append(threading.Thread(target=_pump, args=(proc, log), daemon=True))
                pumps[-1].start()
            elif log is not None:
                log.close()  # the rank holds its own copy
    except BaseException:
        for log in files[len(procs) :]:
            if log is not None:
                log.close()
        RankGroup(procs, [None] * len(procs)).terminate()
        raise
    return RankGroup(procs, list(logs) if logs is not None else [None] * world, pumps)


def _open_log(rank: int, path: Path) -> IO[str]:
    return open(path, "w")  # noqa: SIM115 - handed to the rank's process; closed once it has it


def _pump(proc: subprocess.Popen, log: IO[str]) -> None:
    """Copy a rank's output to its log and to this process's stdout, line by line."""
    with log as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            sys.stdout.write(line)
            sys.stdout.flush()


# ------------------------------------------------------------------ functions


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, env: Mapping[str, str] | None = None) -> RankGroup:
    """``fn(rank, world, *args)`` in ``world`` spawned processes, with the rendezvous variables
    (and ``env``) set in each before ``fn`` runs. What ``fn`` returns is dropped: a rank hands
    results back through files."""
    import torch.multiprocessing as mp

    scratch = Path(tempfile.mkdtemp(prefix="moe-ranks-"))
    port = free_port()
    rank_args = (world, port, dict(env or {}), str(scratch), fn, args)
    context = mp.start_processes(_rank_main, args=rank_args, nprocs=world, join=False, start_method="spawn")
    outputs: list[Path | None] = [scratch / f"rank{rank}.traceback" for rank in range(world)]
    # torch's own copies of a failed rank's traceback (pickled) are not read here: removed too
    leftovers = [scratch, *(Path(f) for f in context.error_files)]
    return RankGroup([_SpawnedProcess(p) for p in context.processes], outputs, cleanup=leftovers)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, env: Mapping[str, str] | None = None, timeout: float | None = None) -> None:
    """``spawn_ranks`` and wait for the ranks; raises RanksFailed (which rank, how, its traceback)
    when one fails."""
    group = spawn_ranks(fn, world, *args, env=env)
    group.wait(timeout=timeout)
    group.check()


def _rank_main(rank: int, world: int, port: int, env: dict[str, str], scratch: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update({**env, **rendezvous_env(rank, world, port)})
    try:
        fn(rank, world, *args)
    except BaseException:
        (Path(scratch) / f"rank{rank}.traceback").write_text(traceback.format_exc())
        raise
