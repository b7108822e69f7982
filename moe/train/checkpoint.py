"""Atomic, layout-independent checkpoints with torch.distributed.checkpoint (DCP).

Layout of ``<dir>``::

    step_00000100/          a complete checkpoint: DCP shards, rng-rank*.pt, meta.json
    latest                  text file naming the newest complete checkpoint
    .tmp-step_00000200/     a save in progress (or one a crash interrupted; ignored, removed)

A save writes into the temporary directory and renames it only once every rank's shards,
RNG states and meta.json are on disk, then rewrites ``latest`` atomically; a crash at any
moment leaves the previous checkpoint as the latest. An asynchronous save (``save_async``, the
trainer's default) copies the tensors to host memory first, then writes, seals and renames from a
background thread over a process group of its own, so training goes on while the disk works; the
next save, a load and the end of the run wait for it (``wait``). meta.json records the sha256 of every
other file and of itself (``meta_sha256``), all verified at load: flipped bytes, an edited
value or a removed checksum list are errors, not garbage weights; loaded tensors must be
finite. A step directory that lost a file is an error, never a silent fall-back to an older
step. A save that fails (a full disk) removes its temporary directory and says why.

Checkpoints come from other people, so loading one never unpickles arbitrary objects: RNG
files load with ``weights_only=True`` and DCP's pickled ``.metadata`` through a restricted
unpickler (:mod:`moe.train.safe_dcp`); anything else is refused naming the file. Tensors are saved under their model
parameter names (fp32 master weights and AdamW moments), so a checkpoint does not depend on
the parallel layout that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moe.digest import sha256_file
from moe.errors import CheckpointError
from moe.reader import FileFormatError, Int, Map, Plain, Str, read_json, read_text
from moe.train.safe_dcp import SafeFileSystemReader, TensorsOnlyLoadPlanner, read_metadata

log = logging.getLogger("moe.train")

MAX_META_BYTES = 64 * 2**20
# meta.json: the fields a load relies on, typed; the caller's own entries (config, loader and
# scheduler state) are plain data that their own loaders validate next.
META_SCHEMA = Map(
    required={"step": Int(0, 10**12), "meta_sha256": Str(64, r"[0-9a-f]{64}"), "files": Map(other=Str(64, r"[0-9a-f]{64}"), max_keys=100_000)},
    optional={"world_size": Int(1, 10**6), "skipped_steps": Int(0), "params_total": Int(0), "params_active": Int(0)},
    other=Plain(),
)

STEP_DIR_NAME = re.compile(r"^step_(\d{8})$")
META = "meta.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if _distributed():
        dist.barrier(group=group)


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
    m = STEP_DIR_NAME.match(path.name)
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected step_NNNNNNNN)")
    return int(m.group(1))


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR_NAME.match(p.name) and is_complete(p)]
    return sorted(found, key=checkpoint_step)


def _missing(path: Path) -> str:
    return ", ".join(n for n in (META, ".metadata") if not (path / n).is_file()) or "nothing"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (``latest`` first, else a scan).

    Step directories only appear complete (renamed into place), so one that lost its
    metadata was damaged afterwards: an error, not a reason to resume an older step."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (checkpoint.dir)")
    steps = sorted((p for p in root.iterdir() if STEP_DIR_NAME.match(p.name) and p.is_dir()), key=checkpoint_step) if root.is_dir() else []
    if steps and not is_complete(steps[-1]):
        raise CheckpointError(
            f"{steps[-1]}: damaged checkpoint (missing {_missing(steps[-1])}); restore it or move it away to resume from an older step"
        )
    pointer = root / "latest"
    if pointer.is_file():
        try:
            name = read_text(pointer, max_bytes=256).strip()
        except FileFormatError:
            raise CheckpointError(f"{pointer}: not a text file naming a checkpoint") from None
        candidate = root / name
        if STEP_DIR_NAME.match(name) and candidate.is_dir() and not is_complete(candidate):
            raise CheckpointError(
                f"{candidate}: damaged checkpoint (missing {_missing(candidate)}); restore it or move it away to resume from an older step"
            )
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint dir, a run's checkpoint root, or ``<root>/latest`` -> a complete checkpoint."""
    p = Path(path)
    if p.name == "latest":
        p = p.parent
    if is_complete(p):
        return p
    if STEP_DIR_NAME.match(p.name) and p.is_dir():
        raise CheckpointError(f"{p}: damaged checkpoint (missing {_missing(p)})")
    found = latest_checkpoint(p)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint found")
    return found


class CheckpointManager:
    """Writes the checkpoints of one run under ``root``: ``save`` blocks until the checkpoint is
    complete; ``save_async`` returns once the tensors are copied to host memory (at most one
    save is in flight; ``wait`` finishes it and raises its error, if it had one)."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3, asynchronous: bool = False) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.asynchronous = asynchronous
        # A group of its own, so the background thread's collectives never interleave with the
        # training's on the default group (made up front: every rank builds the manager together).
        self._group = dist.new_group(backend="gloo") if asynchronous and _distributed() else None
        self._staging: dict[str, torch.Tensor] = {}  # host buffers, reused by every save
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None
        self.last_write_s: float | None = None  # the background write time of the last completed save
        self._fits: bool | None = None  # whether every rank can stage in host memory (decided once)
        self._allocating: threading.Thread | None = None

    def clean_stale(self) -> None:
        """Remove temporary directories that interrupted saves left behind (rank 0)."""
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.glob(".tmp-step_*"):
                shutil.rmtree(p, ignore_errors=True)
        _barrier()

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` atomically; CheckpointError (the temporary directory
        removed) when it cannot be written."""
        self.wait()
        _check_tensors_only(tensors)
        return self._guarded(step, lambda: self._save(step, tensors, meta, rng))

    def save_async(self, step: int, tensors: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any]) -> Path:
        """Stage checkpoint ``step`` in host memory and write it in the background; the returned
        path is complete once ``wait`` returns. The caller may change ``tensors`` right away."""
        self.wait()
        _check_tensors_only(tensors)
        if not self._host_copies_fit(tensors):
            return self.save(step, tensors, meta, rng)
        final = self.root / step_dir_name(step)
        self._guarded(step, lambda: self._prepare_tmp(final))
        start = time.perf_counter()
        staged = self._stage(tensors)
        rng = _stage_tree(rng)  # the generators' states are already copies; their tensors must not alias live ones
        size = sum(t.nbytes for t in self._staging.values()) / 2**30
        if _rank() == 0:
            log.info(
                "checkpoint step %d: %.2f GiB copied to host memory in %.2f s; writing it in the background", step, size, time.perf_counter() - start
            )

        def write() -> None:
            start = time.perf_counter()
            try:
                self._guarded(step, lambda: self._write(final, step, staged, meta, rng, self._group))
                self.last_write_s = time.perf_counter() - start
                if _rank() == 0:
                    log.info("checkpoint step %d written: %s (%.1f s)", step, final, self.last_write_s)
            except CheckpointError as exc:
                self._error = exc

        self._thread = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        return final

    def wait(self) -> float:
        """Finish the save in flight (none: at once); the seconds waited. CheckpointError when it failed."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - start

    def _host_copies_fit(self, tensors: dict[str, Any]) -> bool:
        """Decided at the first save, by every rank together (one rank saving synchronously while
        the others save in the background would pair their collectives wrongly)."""
        if self._fits is None:
            fits = torch.tensor(int(_fits_in_host_memory(tensors)))
            if self._group is not None:
                dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self._group)
            self._fits = bool(fits.item())
        return self._fits

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _guarded(self, step: int, action: Callable[[], Path | None]) -> Path | None:
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        try:
            return action()
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{tmp}: cannot write checkpoint step {step} ({_cause(exc)}){_space_note(self.root)}") from None

    def prepare(self, tensors: dict[str, Any]) -> None:
        """Allocate the host buffers of asynchronous saves now, in a background thread, so the
        first save does not hold training while pinned memory is allocated (measured on one
        H200: 16 s for 21 GiB at the first save, 0.42 s to copy into the kept buffers after)."""
        if not self.asynchronous or self._staging or self._allocating is not None or not self._host_copies_fit(tensors):
            return
        specs = _buffer_specs(tensors)
        if not any(pin for _, _, pin in specs.values()):
            return  # CPU training: a copy costs what an allocation does

        def allocate() -> None:
            for where, (shape, dtype, pin) in specs.items():
                self._staging[where] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)

        self._allocating = threading.Thread(target=allocate, name="checkpoint-host-buffers", daemon=True)
        self._allocating.start()

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Copies of ``tensors`` in host memory (pinned when they come from a GPU), into buffers
        kept for the next save; the device is waited for once, after every copy is queued."""
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        staged = _stage_tree(tensors, self._staging)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return staged

    def _prepare_tmp(self, final: Path) -> None:
        tmp = final.with_name(f".tmp-{final.name}")
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()

    def _save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any]) -> Path:
        final = self.root / step_dir_name(step)
        self._prepare_tmp(final)
        return self._write(final, step, tensors, meta, rng, None)

    def _write(self, final: Path, step: int, tensors: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any], group) -> Path:
        """DCP shards and this rank's RNG file into the prepared temporary directory; then rank 0
        seals meta.json, renames the directory into place, points ``latest`` at it and prunes."""
        tmp = final.with_name(f".tmp-{final.name}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, checkpoint_id=tmp, process_group=group, no_dist=not _distributed())
        rank = _rank()
        with open(tmp / f"rng-rank{rank:05d}.pt", "wb") as f:
            torch.save(rng, f)
            f.flush()
            os.fsync(f.fileno())
        _barrier(group)
        if rank == 0:
            world = dist.get_world_size() if _distributed() else 1
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != META}
            sealed = {**meta, "step": step, "world_size": world, "files": files}
            sealed["meta_sha256"] = meta_digest(sealed)
            _write_atomic(tmp / META, json.dumps(sealed, indent=2, sort_keys=True))
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
        _barrier(group)
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
        meta = read_meta(path)
        rng_file = path / f"rng-rank{_rank():05d}.pt"
        same_world = meta.get("world_size") == (dist.get_world_size() if _distributed() else 1)
        rng = load_plain(rng_file) if rng_file.is_file() and same_world else None
        return meta, rng


def _stage_tree(tree: Any, buffers: dict[str, torch.Tensor] | None = None, where: str = "") -> Any:
    """The same tree with every tensor copied to host memory: into ``buffers[where]`` when one of
    that shape is kept there (pinned for GPU tensors), so saves after the first allocate nothing.
    A DTensor (FSDP) stays a DTensor around its copied local shard, as DCP needs."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: _stage_tree(v, buffers, f"{where}.{k}" if where else str(k)) for k, v in tree.items()}
    if not isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, DTensor):
        local = _stage_tree(tree.to_local(), buffers, where)
        return DTensor.from_local(local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape, stride=tree.stride())
    buf = buffers.get(where) if buffers is not None else None
    if buf is None or buf.shape != tree.shape or buf.dtype != tree.dtype:
        buf = torch.empty(tree.shape, dtype=tree.dtype, device="cpu", pin_memory=tree.is_cuda)
        if buffers is not None:
            buffers[where] = buf
    buf.copy_(tree.detach(), non_blocking=tree.is_cuda)
    return buf


def _buffer_specs(tree: Any, where: str = "") -> dict[str, tuple[torch.Size, torch.dtype, bool]]:
    """The host buffers _stage_tree fills, by the same keys: (shape, dtype, pinned)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _buffer_specs(sub, f"{where}.{key}" if where else str(key)).items()}
    if not isinstance(tree, torch.Tensor):
        return {}
    local = tree.to_local() if isinstance(tree, DTensor) else tree
    return {where: (local.shape, local.dtype, local.is_cuda)}


def _fits_in_host_memory(tensors: dict[str, Any]) -> bool:
    """Whether this node's ranks can each hold a host copy of their GPU tensors within 80% of
    the memory the kernel calls available; if not, the save is synchronous (with a warning)."""
    from torch.distributed.tensor import DTensor

    need = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for _, t in _leaves(tensors) if t.is_cuda)
    need *= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _host_memory_available()
    if need == 0 or available is None or need <= 0.8 * available:
        return True
    log.warning(
        "checkpoint: %.1f GiB of host copies for this node's ranks do not fit in 80%% of its %.1f GiB of available memory: saving synchronously",
        need / 2**30,
        available / 2**30,
    )
    return False


def _host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_tensors_only(tree: Any, where: str = "") -> None:
    """A checkpoint holds tensors only: anything else would be pickled (and need unpickling)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            _check_tensors_only(v, f"{where}.{k}" if where else str(k))
    elif not isinstance(tree, torch.Tensor):
        raise CheckpointError(f"checkpoint entry {where!r} is a {type(tree).__name__}; checkpoints hold tensors only")


def _space_note(root: Path) -> str:
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        return ""
    return f"; {free / 2**30:.2f} GiB free on its file system" + (" (the disk is full)" if free < 64 * 2**20 else "")


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of meta.json's content without its own checksum (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_plain(path: Path) -> Any:
    """A file of tensors and plain values; anything that needs unpickling code is refused."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):  # RNG files of earlier versions
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:  # weights_only found something that would need code to rebuild
        raise CheckpointError(f"{path}: refused: it holds objects other than tensors and plain values (loading it could run code)") from None
    except Exception as exc:  # RuntimeError/EOFError when truncated or not a torch file
        raise CheckpointError(f"{path}: refused: not a plain tensor file ({_first_line(exc)})") from None


def _numpy_array_globals() -> list[Any]:
    """What rebuilds a plain numpy array (numbers only; no code): earlier RNG files hold one."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def verify_files(path: Path, meta: dict[str, Any]) -> None:
    """Every file meta.json lists is present with its recorded sha256; the list itself is
    covered by meta.json's own checksum (read_meta), so it cannot be removed to skip this."""
    files = meta.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"{path / META}: 'files' must map every file of the checkpoint to its sha256")
    for name, digest in sorted(files.items()):
        f = path / name
        if "/" in name or name.startswith(".."):
            raise CheckpointError(f"{path / META}: bad file name {name!r}")
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f}: sha256 does not match meta.json: the file is corrupt")


def load_tensors(path: str | os.PathLike, tensors: dict[str, Any]) -> None:
    """DCP-load (a subset of) a checkpoint's tensors in place; resharded to this layout."""
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    verify_files(path, meta)
    try:
        metadata = read_metadata(path / ".metadata")
    except Exception as exc:  # a foreign object, or not a pickle at all
        raise CheckpointError(f"{path / '.metadata'}: refused: not DCP checkpoint metadata ({_first_line(exc)})") from None
    unlisted = sorted({i.relative_path for i in (metadata.storage_data or {}).values()} - set(meta["files"]))
    if unlisted:
        raise CheckpointError(f"{path / '.metadata'}: refused: its storage file {unlisted[0]} is not checksummed in meta.json")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=SafeFileSystemReader(path), planner=TensorsOnlyLoadPlanner(), no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot load into this model/optimizer ({_cause(exc)})") from exc
    check_finite(tensors, path)


def check_finite(tensors: dict[str, Any], path: Path) -> None:
    """Every loaded floating-point value is finite: a NaN or inf weight is damage, never trained state."""
    for key, t in _leaves(tensors):
        if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path}: tensor {key} holds non-finite values (NaN or inf); refusing to load it")


def _leaves(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _cause(exc: BaseException) -> str:
    """The first rank's underlying error of a DCP CheckpointException, in one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a checkpoint, verified against its own checksum and its directory's step."""
    ckpt = resolve_checkpoint(path)
    file = ckpt / META
    try:
        meta = read_json(file, Plain(), MAX_META_BYTES)
    except FileFormatError as exc:
        raise CheckpointError(f"unreadable: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool):
        raise CheckpointError(f"{file}: not a checkpoint's meta.json (no integer 'step')")
    if not isinstance(meta.get("meta_sha256"), str):
        raise CheckpointError(f"{file}: has no meta_sha256 (written by an older version, or edited); refusing it")
    if meta["meta_sha256"] != meta_digest(meta):
        raise CheckpointError(f"{file}: does not match its meta_sha256: it was edited or damaged")
    try:
        META_SCHEMA.check(meta, f"{file}: ")
    except FileFormatError as exc:
        raise CheckpointError(str(exc)) from None
    if meta["step"] != checkpoint_step(ckpt):
        raise CheckpointError(f"{file}: says step {meta['step']}, but the directory is {ckpt.name}")
    if not isinstance(meta.get("config", {}), dict):
        raise CheckpointError(f"{file}: 'config' is not a mapping")
    return meta
