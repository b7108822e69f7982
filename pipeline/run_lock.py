"""One writer per run: an exclusive lock on ``.lock`` in every directory a run writes (its run
directory and its checkpoint directory), naming its holder.

``flock`` is released by the kernel when the holding process dies (kill -9 included), so a
stale lock never blocks a resume; on NFS Linux maps it to a POSIX lock, which other nodes see.
The file itself is left in place (removing it would let two processes lock different files),
is never followed if it is a symlink, and is taken before a run touches anything.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import stat
import sys
from pathlib import Path

from pipeline.errors import PipelineError

LOCK_NAME = ".lock"
_HELD_HERE: dict[str, int] = {}  # lock file -> how many RunLock objects of this process hold it


class RunDirBusy(PipelineError):
    """Another process writes this run directory."""


def describe_holder(info: dict) -> str:
    where = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
    if info.get("slurm_job_id"):
        where = f"slurm job {info['slurm_job_id']} ({where})"
    return f"{where}: {info.get('command', '?')}, since {info.get('since', '?')}"


class RunLock:
    """``RunLock(run_dir, checkpoint_dir)``: both directories, or neither."""

    def __init__(self, run_dir: str | os.PathLike, *also: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.dirs = list(dict.fromkeys(Path(os.path.abspath(d)) for d in (run_dir, *also)))
        self.path = self.run_dir / LOCK_NAME
        self._fds: list[tuple[str, int]] = []

    def acquire(self, command: str, reentrant: bool = False) -> RunLock:
        """Take every lock or raise RunDirBusy naming the holder (taking none). ``reentrant``:
        a lock this process already holds (the stage, for the executor it starts) is shared."""
        try:
            for d in self.dirs:
                self._take(d, command, reentrant)
        except BaseException:
            self.release()
            raise
        return self

    def _take(self, directory: Path, command: str, reentrant: bool) -> None:
        path = directory / LOCK_NAME
        key = str(path)
        if reentrant and _HELD_HERE.get(key):
            _HELD_HERE[key] += 1
            self._fds.append((key, -1))
            return
        directory.mkdir(parents=True, exist_ok=True)
        try:
            # O_NONBLOCK: a FIFO planted at the name must not block the open
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError:
            if path.is_symlink():
                raise PipelineError(f"{path}: is a symlink; a run's lock file must be a plain file (remove the link)") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise PipelineError(f"{path}: is not a plain file; a run's lock file must be one (remove it)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(f"{directory}: in use by {describe_holder(holder)} (lock {path}); wait for it to end or stop it first") from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _HELD_HERE[key] = 1
        self._fds.append((key, fd))

    def check_free(self) -> None:
        """Raise RunDirBusy when someone holds a lock (for a submitter whose job takes it)."""
        self.acquire("check").release()

    def release(self) -> None:
        while self._fds:
            key, fd = self._fds.pop()
            _HELD_HERE[key] = _HELD_HERE.get(key, 1) - 1
            if fd < 0:
                continue
            _HELD_HERE.pop(key, None)
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

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
