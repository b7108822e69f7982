"""Atomic, layout-independent checkpoints with torch.distributed.checkpoint (DCP).

Layout of ``<dir>``::

    step_00000100/          a complete checkpoint: DCP shards, rng-rank*.pt, meta.json
    latest                  text file naming the newest complete checkpoint
    .tmp-step_00000200/     a save in progress (or one a crash interrupted; ignored, removed)

A save writes into the temporary directory and renames it only once every rank's shards,
RNG states and meta.json are on disk, then rewrites ``latest`` atomically; a crash at any
moment leaves the previous checkpoint as the latest. Tensors are saved under their model
parameter names (fp32 master weights and AdamW moments), so a checkpoint does not depend on
the parallel layout that wrote it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

_STEP_DIR = re.compile(r"^step_(\d{8})$")
META = "meta.json"


class CheckpointError(RuntimeError):
    pass


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file()


def checkpoint_step(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected step_NNNNNNNN)")
    return int(m.group(1))


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (``latest`` first, else a scan)."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if is_complete(candidate):
            newer = [p for p in list_checkpoints(root) if checkpoint_step(p) > checkpoint_step(candidate)]
            return newer[-1] if newer else candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint dir, a run's checkpoint root, or ``<root>/latest`` -> a complete checkpoint."""
    p = Path(path)
    if p.name == "latest":
        p = p.parent
    if is_complete(p):
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint found")
    return found


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def clean_stale(self) -> None:
        """Remove temporary directories that interrupted saves left behind (rank 0)."""
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.glob(".tmp-step_*"):
                shutil.rmtree(p, ignore_errors=True)
        _barrier()

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any]) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, checkpoint_id=tmp, no_dist=not _distributed())
        rank = _rank()
        with open(tmp / f"rng-rank{rank:05d}.pt", "wb") as f:
            torch.save(rng, f)
            f.flush()
            os.fsync(f.fileno())
        _barrier()
        if rank == 0:
            world = dist.get_world_size() if _distributed() else 1
            _write_atomic(tmp / META, json.dumps({**meta, "step": step, "world_size": world}, indent=2, sort_keys=True))
            _fsync_dir(tmp)
            if final.exists():  # re-saving a step (e.g. after resuming from it): replace it
                trash = self.root / f".tmp-old-{final.name}"
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
            _write_atomic(self.root / "latest", final.name + "\n")
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        complete = list_checkpoints(self.root)
        for old in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load(path: str | os.PathLike, tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Load tensors in place; return (meta, this rank's RNG state or None)."""
        path = resolve_checkpoint(path)
        load_tensors(path, tensors)
        meta = json.loads((path / META).read_text())
        rng_file = path / f"rng-rank{_rank():05d}.pt"
        rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() and meta.get("world_size") == (
            dist.get_world_size() if _distributed() else 1
        ) else None
        return meta, rng


def load_tensors(path: str | os.PathLike, tensors: dict[str, Any]) -> None:
    """DCP-load (a subset of) a checkpoint's tensors in place; resharded to this layout."""
    path = resolve_checkpoint(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=path, no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot load into this model/optimizer ({_cause(exc)})") from exc


def _cause(exc: BaseException) -> str:
    """The first rank's underlying error of a DCP CheckpointException, in one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((resolve_checkpoint(path) / META).read_text())
