"""Stage outputs replace only what a stage provably wrote, and no write follows a symlink.

Directories (``tokenize.output``, ``convert --out``): the stage's record file inside the
output (``manifest.json``, ``moe_conversion.json``) lists every other file it wrote with its
size and sha256. An existing directory is replaced only when it is absent, empty, or holds
exactly the files its record lists, unchanged; anything else (a user's folder that happens to
hold a file of the same name, an output a user has edited or added to) is refused before any
work, naming the key and the first file that does not belong.

Single files (metrics, plots, samples): the sha256 of what we wrote, and which writer (the
config key or output name) wrote it, are kept in the directory's ledger ``.moe-outputs.json``;
an existing file is overwritten only when the ledger says this writer wrote exactly this
content (another stage's output in the same folder is not this one's), or when a recogniser
that reads its content says it is this writer's format (a fresh clone that carries the
outputs but not the ledger); a ledger that is not ours (a FIFO, a damaged file) is refused,
naming it, before the stage writes. Every write goes to a
temporary name in the same directory and is renamed over the target, which replaces a
symlink itself instead of writing through it; a symlink where an output belongs is refused.

A file name read from a record (a stage's ``written_files``, an HF index's ``weight_map``) is
taken only through :func:`inside`: it names a file in the record's own folder, or the record is
refused. A copy of another output's file is a copy (:func:`clone_file`), never a hard link: an
edit of one output must not change another.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from moe.digest import sha256_file
from moe.reader import AnyOf, FileFormatError, Int, List, Map, Nullable, Num, Plain, Str, read_bytes, read_json
from pipeline.errors import PipelineError

LEDGER = ".moe-outputs.json"
Recognise = Callable[[Path], bool]

SHA256_HEX = Str(64, r"[0-9a-f]{64}")
# A stage record's written_files (file_record): every file the stage wrote, by its path relative to
# the output (inside() checks each name before it is used), with its size and sha256.
WRITTEN_FILES = Map(other=Map(required={"size": Int(0), "sha256": SHA256_HEX}), keys=Str(4096), max_keys=1_000_000)
MAX_RECORD_BYTES = 64 << 20  # a million files' entries: far larger is not a record of ours
# The directory's ledger (record_output_file): file name -> the sha256 of what the writer (a config
# key or output name) wrote; an entry of the older form is a bare sha256 (it vouches for nothing).
_LEDGER_ENTRY = AnyOf((Map(required={"sha256": SHA256_HEX, "by": Str(4096)}), SHA256_HEX), "a {sha256, by} entry or a bare sha256")
LEDGER_SCHEMA = Map(other=_LEDGER_ENTRY, keys=Str(255, r"[^/\x00]+"), max_keys=100_000)
MAX_LEDGER_BYTES = 16 << 20
MAX_CSV_BYTES = 256 << 20  # a recogniser reads the whole file: our plots' CSVs (a row per step) stay far below


# ------------------------------------------------------------------ plain safe writes


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename (never through a
    symlink at ``path``); a failure (a full disk) leaves the old file and no temporary."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    payload = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, most often: name the file
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def open_for_write(path: str | os.PathLike, append: bool = False):
    """A text file opened for writing that refuses to follow a symlink (logs, spools)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if Path(path).is_symlink():
            raise PipelineError(f"{path}: is a symlink; refusing to write through it") from None
        raise exc
    return os.fdopen(fd, "a" if append else "w")


# ------------------------------------------------------------------ names a record holds


def inside(folder: Path, name: object, where: str) -> Path:
    """``folder/name`` for a relative path ``name`` that a record lists (``where``: the record
    file and the entry's key), refused unless it stays inside ``folder``: no absolute path, no
    ``..`` part, no symlink on the way that leads out. A record we follow must never make us read,
    link or write anyone else's file."""
    if not isinstance(name, str) or name in ("", ".") or "\0" in name or "\\" in name:
        raise PipelineError(f"{where}: {name!r} is not a file name inside {folder}; refusing it")
    parts = name.split("/")
    if PurePosixPath(name).is_absolute() or any(part in ("", ".", "..") for part in parts):
        raise PipelineError(f"{where}: {name!r} is not a relative path inside {folder} (an absolute path or a '..' part); refusing it")
    path = folder.joinpath(*parts)
    target = path.resolve()
    if not target.is_relative_to(folder.resolve()):
        raise PipelineError(f"{where}: {name!r} is a symlink pointing outside {folder} (to {target}); refusing it")
    return path


def enclosing_output(path: Path, record_names: tuple[str, ...]) -> Path | None:
    """The record of the nearest directory at or above ``path`` that holds one (a file of
    ``record_names`` listing its ``written_files``): another stage's output; None where none does."""
    for directory in (path, *path.parents):
        for name in record_names:
            record = directory / name
            if record.is_file() and not record.is_symlink() and _lists_written_files(record):
                return record
    return None


# What makes a JSON file a stage's record, to recognise one (its entries are checked where they are used).
_RECORD_SHAPE = Map(required={"written_files": Map(other=Plain(), keys=Str(4096), max_keys=1_000_000)}, other=Plain())


def _lists_written_files(record: Path) -> bool:
    """A stage's record: a JSON object with a ``written_files`` mapping (a web app's manifest.json is not one)."""
    try:
        read_json(record, _RECORD_SHAPE, MAX_RECORD_BYTES)
    except FileFormatError:
        return False
    return True


# ------------------------------------------------------------------ copies


def clone_file(src: Path, dst: Path) -> None:
    """``dst``: a new file with ``src``'s bytes and mode that shares nothing with it (editing
    one never changes the other; a hard link would). A copy-on-write clone where the filesystem
    offers one (btrfs, XFS: no extra space), else an in-kernel copy, else read and write. Neither
    path may be a symlink; ``dst`` must not exist."""
    src_fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = stat.S_IMODE(os.fstat(src_fd).st_mode)
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            if not _reflink(src_fd, dst_fd):
                _copy_bytes(src_fd, dst_fd)
            os.fchmod(dst_fd, mode)  # what the umask took from os.open's mode
            os.fsync(dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.EPERM, errno.ENOSYS, errno.EBADF}


def _reflink(src_fd: int, dst_fd: int) -> bool:
    """A copy-on-write clone of the whole file (False: this filesystem offers none)."""
    try:
        import fcntl

        fcntl.ioctl(dst_fd, FICLONE, src_fd)
    except (ImportError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _NO_CLONE:
            raise
        return False
    return True


def _copy_bytes(src_fd: int, dst_fd: int) -> None:
    """Every byte of ``src_fd`` into ``dst_fd``: in the kernel (copy_file_range) where it can, else through Python."""
    try:
        while os.copy_file_range(src_fd, dst_fd, 1 << 30):
            pass
        return
    except (AttributeError, OSError) as exc:  # no copy_file_range (an old kernel, another OS) or not across these filesystems
        if isinstance(exc, OSError) and exc.errno not in _NO_CLONE:
            raise
    os.lseek(src_fd, 0, os.SEEK_SET)
    os.lseek(dst_fd, 0, os.SEEK_SET)
    os.ftruncate(dst_fd, 0)
    while chunk := os.read(src_fd, 1 << 20):
        while chunk:
            chunk = chunk[os.write(dst_fd, chunk) :]


# ------------------------------------------------------------------ single files


def _ledger_path(path: Path) -> Path:
    return path.parent / LEDGER


def _read_ledger(directory: Path, key: str | None = None) -> dict[str, dict[str, str]]:
    """name -> {"sha256": ..., "by": writer} (none while there is no ledger); an entry of the older
    form (a bare sha256) names no writer and so vouches for nothing (the recogniser decides). A
    ledger that is not ours (a FIFO, a device, a damaged or foreign file) is refused at once,
    naming the writer ``key`` whose output it stands beside."""
    path = directory / LEDGER
    if not os.path.lexists(path):
        return {}
    try:
        data = read_json(path, LEDGER_SCHEMA, MAX_LEDGER_BYTES)
    except FileFormatError as exc:
        raise PipelineError(
            f"{key + ': ' if key else ''}{exc} (the ledger of the outputs written in {directory}: move it away, "
            "and those outputs are recognised by their content)"
        ) from None
    return {name: entry for name, entry in data.items() if isinstance(entry, dict)}


def is_own_file(path: Path, recognise: Recognise | None = None, key: str | None = None) -> bool:
    """Whether ``path`` is an output of the writer ``key``: the ledger records this writer and
    this content, or ``recognise`` reads it as this writer's format."""
    if path.is_symlink() or not path.is_file():
        return False
    recorded = _read_ledger(path.parent, key).get(path.name)
    if recorded is not None and recorded["by"] == key and recorded["sha256"] == sha256_file(path):
        return True
    if recognise is None:
        return False
    try:
        return bool(recognise(path))
    except (OSError, ValueError, UnicodeDecodeError):
        return False


def check_output_file(path: str | os.PathLike, key: str, recognise: Recognise | None = None) -> None:
    """Before any work: ``path`` is absent or a file this stage wrote, else refuse naming ``key``."""
    path = Path(path)
    if path.is_symlink():
        raise PipelineError(f"{key}: {path} is a symlink; refusing to write through it (remove it or choose another path)")
    _read_ledger(path.parent, key)  # the ledger this write will update: one not ours is refused before any work
    if not path.exists():
        return
    if not path.is_file():
        raise PipelineError(f"{key}: {path} exists and is not a file this stage wrote; refusing to replace it")
    if not is_own_file(path, recognise, key):
        raise PipelineError(
            f"{key}: {path} exists and was not written by this stage (or was changed since); "
            "refusing to overwrite it: choose another path or move the file away"
        )


def write_output_file(path: str | os.PathLike, data: str | bytes, key: str, recognise: Recognise | None = None) -> Path:
    """Write an output file, replacing an existing one only when it is ours; record it in the
    directory's ledger."""
    path = Path(path)
    check_output_file(path, key, recognise)
    write_atomic(path, data)
    record_output_file(path, key)
    return path


def record_output_file(path: Path, key: str) -> None:
    """Enter a file just written by the writer ``key`` into its directory's ledger."""
    ledger = _read_ledger(path.parent, key)
    ledger[path.name] = {"sha256": sha256_file(path), "by": key}
    write_atomic(_ledger_path(path), json.dumps(ledger, indent=2, sort_keys=True) + "\n")


def json_keys_within(allowed: set[str], required: str | set[str], max_bytes: int = MAX_RECORD_BYTES) -> Recognise:
    """A recogniser for our JSON metrics files: an object holding every ``required`` key and no
    key of another schema (require all the keys the writer always writes: a user's
    ``{"val_loss": 3.2}`` must not pass for a file with a dozen). A file that is not JSON, not a
    regular file or over ``max_bytes`` is not ours."""
    needed = {required} if isinstance(required, str) else set(required)

    def recognise(path: Path) -> bool:
        try:
            data = read_json(path, Plain(), max_bytes)
        except FileFormatError:
            return False
        return isinstance(data, dict) and needed <= set(data) <= allowed

    return recognise


def csv_header(header: list[str], max_bytes: int = MAX_CSV_BYTES) -> Recognise:
    """A recogniser for our CSV files: the first line is ``header``."""
    expected = ",".join(header).encode()

    def recognise(path: Path) -> bool:
        try:
            raw = read_bytes(path, max_bytes)
        except FileFormatError:
            return False
        return re.split(rb"\r\n|\r|\n", raw, maxsplit=1)[0] == expected

    return recognise


# ------------------------------------------------------------------ directories


# A stage's record as _foreign reads it: the files it wrote, beside the stage's own fields (each
# stage reads those with its own schema: tokenize's MANIFEST_SCHEMA, convert's CONVERSION_RECORD_SCHEMA).
OUTPUT_RECORD_SCHEMA = Map(required={"written_files": WRITTEN_FILES}, other=Plain())


def file_record(directory: Path, exclude: str) -> dict[str, dict[str, Any]]:
    """Every file under ``directory`` (but ``exclude``): relative path -> size and sha256."""
    out = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if rel == exclude or p.is_dir():
            continue
        out[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def _foreign(out: Path, record_name: str) -> str | None:
    """The first thing in ``out`` its record does not vouch for (None: all of it is ours)."""
    record_path = out / record_name
    if record_path.is_symlink() or not record_path.is_file():
        return f"no {record_name}"
    try:
        files = read_json(record_path, OUTPUT_RECORD_SCHEMA, MAX_RECORD_BYTES)["written_files"]
    except FileFormatError as exc:
        return f"{record_name} does not list the files this stage wrote ({str(exc).removeprefix(f'{record_path}: ')})"
    for name in files:
        inside(out, name, f"{record_path}: written_files")
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if rel == record_name:
            continue
        if p.is_symlink():
            return f"{rel} (a symlink)"
        if p.is_dir():
            if not any(f.startswith(rel + "/") for f in files):
                return f"{rel}/"
            continue
        if not p.is_file():  # a FIFO or a device: never opened to hash it
            return f"{rel} (not a regular file)"
        entry = files.get(rel)
        if entry is None:
            return rel
        if p.stat().st_size != entry["size"] or sha256_file(p) != entry["sha256"]:
            return f"{rel} (changed since it was written)"
    return None


def check_own_output(out: Path, record_name: str, key: str) -> None:
    """Before any work: ``out`` is absent, empty, or exactly our earlier output."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise PipelineError(f"{key}: {out} exists and is not a directory this stage wrote; refusing to replace it")
    if not any(out.iterdir()):
        return
    foreign = _foreign(out, record_name)
    if foreign is not None:
        raise PipelineError(
            f"{key}: {out} exists and holds files this stage did not write ({foreign}); "
            "refusing to replace it: choose another directory or move it away"
        )


def seal_output(tmp: Path, record_name: str, record: dict[str, Any]) -> dict[str, Any]:
    """Write the record file into the finished ``tmp``, listing every file in it."""
    sealed = {**record, "written_files": file_record(tmp, record_name)}
    write_atomic(tmp / record_name, json.dumps(sealed, indent=2, sort_keys=True) + "\n")
    return sealed


def fresh_temp_dir(beside: Path) -> Path:
    """A new, empty directory beside ``beside`` (same filesystem, so renames are atomic) under a
    name nobody else has: never an existing path, so removing it later removes only ours."""
    import tempfile

    beside.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 is for its privacy; the output it becomes follows the user's umask
    return tmp


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def replace_own_output(tmp: Path, out: Path, record_name: str, key: str) -> None:
    """Move the finished ``tmp`` to ``out``, removing only our own earlier output."""
    check_own_output(out, record_name, key)  # again: it may have changed while we worked
    if out.exists():
        holder = fresh_temp_dir(out)
        os.replace(out, holder / "old")
        os.replace(tmp, out)
        shutil.rmtree(holder, ignore_errors=True)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)


# ------------------------------------------------------------------ the tokenize stage's record
# manifest.json of tokenize.output, written by pipeline.stages.tokenize.run_tokenize; read back by
# that stage's readers and by the model card (a lower floor: so its schema lives here).

MANIFEST_FORMAT = "olmo-core-tokens/1"
_TEXT = Str(4096)
_COUNT = Int(0, 2**63 - 1)
_TOKEN_ID = Int(0, 2**32 - 1)
_SPLIT = Map(required={"files": List(Str(64, r"part-[0-9]{5,}\.npy"), max_len=10_000_000), "documents": _COUNT, "tokens": _COUNT})
# Its params: what determines the content (pipeline.stages.tokenize leaves out NOT_CONTENT_PARAMS; a
# manifest of an older version holds stall_timeout_s).
_PARAMS = Map(
    optional={
        "inputs": List(_TEXT, max_len=100_000),
        "text_field": Str(256),
        "tokenizer": Nullable(_TEXT),
        "vocab_size": Int(1, 2**32),
        "max_bytes": Nullable(Int(1)),
        "max_document_bytes": Int(1),
        "val_fraction": Num(0, 1),
        "seed": Int(0),
        "shard_tokens": Int(1),
        "stall_timeout_s": Num(0),
    }
)
# Its whole record, as run_tokenize writes it (written_files: sealed in by seal_output); the skipped
# lists and written_files are absent from the manifests of older versions.
MANIFEST_SCHEMA = Map(
    required={
        "format": Str(choices=(MANIFEST_FORMAT,)),
        "tokenizer": Map(
            required={"sha256": SHA256_HEX, "vocab_size": Int(1, 2**32), "eos_id": _TOKEN_ID},
            optional={"source": _TEXT, "eos_token": Str(256), "pad_id": Nullable(_TOKEN_ID), "pad_token": Nullable(Str(256))},
        ),
        "inputs": List(_TEXT, max_len=100_000),
        "splits": Map(required={"train": _SPLIT, "val": _SPLIT}),
    },
    optional={
        "sources": _COUNT,
        "skipped_files": List(_TEXT, max_len=10_000_000),
        "skipped_documents": List(Map(required={"source": _TEXT, "reason": _TEXT}), max_len=10_000_000),
        "params": _PARAMS,
        "written_files": WRITTEN_FILES,
    },
)
MAX_MANIFEST_BYTES = 256 << 20  # a manifest listing millions of skipped documents still fits
