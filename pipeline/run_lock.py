"""One writer per run directory: an exclusive lock on ``<run_dir>/.lock`` naming its holder.

``flock`` is released by the kernel when the holding process dies (kill -9 included), so a
stale lock never blocks a resume; on NFS Linux maps it to a POSIX lock, which other nodes see.
The file itself is left in place (removing it would let two processes lock different files).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from pipeline.errors import PipelineError

LOCK_NAME = ".lock"


class RunDirBusy(PipelineError):
    """Another process writes this run directory."""


def describe_holder(info: dict) -> str:
    where = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
    if info.get("slurm_job_id"):
        where = f"slurm job {info['slurm_job_id']} ({where})"
    return f"{where}: {info.get('command', '?')}, since {info.get('since', '?')}"


class RunLock:
    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, command: str) -> RunLock:
        """Take the lock or raise RunDirBusy naming the holder; records who holds it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"{self.run_dir}: in use by {describe_holder(holder)} (lock {self.path}); "
                "wait for it to end or stop it first"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def check_free(self) -> None:
        """Raise RunDirBusy when someone holds the lock (for a submitter whose job takes it)."""
        self.acquire("check").release()

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def command_line() -> str:
    """Program and subcommand only: arguments may carry values nobody else should read."""
    return " ".join([os.path.basename(sys.argv[0]) or "python", *sys.argv[1:2]])
