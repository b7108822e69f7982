"""Token files in the OLMo-core layout, plus our JSON sidecar.

A token file is a flat, headerless array of little-endian uint16 or uint32 token ids (named
``.npy`` by OLMo-core's convention, but without a NumPy header), documents separated by the EOS
id. Beside ``part.npy`` we write ``part.npy.json``: dtype, vocab size, eos/pad ids, the
tokenizer's sha256, the token count and the file's sha256. Files are written atomically
(temporary name, then rename; the sidecar last), so a half-written file never looks valid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from moe.digest import sha256_file as file_sha256  # moe.data's name for it
from moe.errors import TokenDataError  # noqa: F401 - raised here, defined with every other error

SIDECAR_SUFFIX = ".json"
FORMAT = "olmo-core-tokens/1"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclasses.dataclass(frozen=True)
class TokenFileInfo:
    dtype: str
    vocab_size: int
    eos_id: int
    pad_id: int | None
    tokenizer_hash: str | None
    num_tokens: int
    sha256: str
    num_documents: int | None = None
    format: str = FORMAT


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + SIDECAR_SUFFIX)


def write_token_file(
    path: str | os.PathLike,
    tokens: np.ndarray,
    *,
    vocab_size: int,
    eos_id: int,
    pad_id: int | None = None,
    tokenizer_hash: str | None = None,
    num_documents: int | None = None,
) -> TokenFileInfo:
    path = Path(path)
    dtype = dtype_for_vocab(vocab_size)
    arr = np.ascontiguousarray(tokens, dtype=_DTYPES[dtype])
    if arr.ndim != 1:
        raise TokenDataError(f"{path}: tokens must be one flat array, got shape {arr.shape}")
    if arr.size and int(arr.max()) >= vocab_size:
        raise TokenDataError(f"{path}: token id {int(arr.max())} is outside the vocabulary of {vocab_size}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    data = arr.tobytes()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # a full disk: say which file, leave no temporary behind
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    info = TokenFileInfo(
        dtype=dtype,
        vocab_size=vocab_size,
        eos_id=eos_id,
        pad_id=pad_id,
        tokenizer_hash=tokenizer_hash,
        num_tokens=int(arr.size),
        sha256=hashlib.sha256(data).hexdigest(),
        num_documents=num_documents,
    )
    side = sidecar_path(path)
    side.unlink(missing_ok=True)  # never leave a stale sidecar describing the new file
    os.replace(tmp, path)
    _write_json_atomic(side, dataclasses.asdict(info))
    return info


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    except OSError as exc:  # a full disk: say which file, leave no temporary behind
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    os.replace(tmp, path)


def read_sidecar(path: str | os.PathLike) -> TokenFileInfo:
    side = sidecar_path(path)
    if not Path(path).is_file():
        raise TokenDataError(f"{path}: token file not found")
    if not side.is_file():
        raise TokenDataError(f"{path}: sidecar {side.name} not found (was the file written by `moe tokenize`?)")
    if side.stat().st_size > SIDECAR_LIMIT:
        raise TokenDataError(f"{side}: a sidecar of {side.stat().st_size} bytes is not one of ours (at most {SIDECAR_LIMIT})")
    try:
        raw = json.loads(side.read_bytes())
        if not isinstance(raw, dict):
            raise ValueError(f"a {type(raw).__name__}, not an object")
        fields = {f.name for f in dataclasses.fields(TokenFileInfo)}
        info = TokenFileInfo(**{k: v for k, v in raw.items() if k in fields})
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise TokenDataError(f"{side}: unreadable sidecar ({exc})") from None
    problem = _sidecar_problem(info)
    if problem:
        raise TokenDataError(f"{side}: {problem}")
    return info


SIDECAR_LIMIT = 1 << 20


def _is_int(v: object) -> bool:
    return type(v) is int


def _sidecar_problem(info: TokenFileInfo) -> str | None:
    """What is wrong with a sidecar's fields (types and ranges), or None."""
    if info.format != FORMAT:
        return f"format {info.format!r} is not {FORMAT!r}"
    if info.dtype not in _DTYPES:
        return f"unknown dtype {info.dtype!r}"
    if not _is_int(info.vocab_size) or not 0 < info.vocab_size <= 2**32:
        return f"vocab_size {info.vocab_size!r} is not an integer in 1..2^32"
    if dtype_for_vocab(info.vocab_size) == "uint32" and info.dtype == "uint16":
        return f"dtype uint16 cannot hold vocab_size {info.vocab_size}"
    for name in ("eos_id", "pad_id"):
        v = getattr(info, name)
        if (v is not None or name == "eos_id") and (not _is_int(v) or not 0 <= v < info.vocab_size):
            return f"{name} {v!r} is not a token id below vocab_size {info.vocab_size}"
    for name in ("num_tokens", "num_documents"):
        v = getattr(info, name)
        if (v is not None or name == "num_tokens") and (not _is_int(v) or v < 0):
            return f"{name} {v!r} is not a count"
    if not isinstance(info.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", info.sha256):
        return f"sha256 {info.sha256!r} is not a sha256 digest"
    if info.tokenizer_hash is not None and not isinstance(info.tokenizer_hash, str):
        return f"tokenizer_hash {info.tokenizer_hash!r} is not text"
    return None


def open_token_file(
    path: str | os.PathLike,
    *,
    verify_checksum: bool = True,
    tokenizer_hash: str | None = None,
) -> tuple[np.memmap | np.ndarray, TokenFileInfo]:
    """Memory-map a token file after checking it against its sidecar."""
    info = read_sidecar(path)
    dtype = _DTYPES[info.dtype]
    size = Path(path).stat().st_size
    if size != info.num_tokens * dtype.itemsize:
        raise TokenDataError(
            f"{path}: {size} bytes but the sidecar says {info.num_tokens} {info.dtype} tokens "
            f"({info.num_tokens * dtype.itemsize} bytes): truncated or corrupt"
        )
    if tokenizer_hash is not None and info.tokenizer_hash != tokenizer_hash:
        raise TokenDataError(
            f"{path}: made with tokenizer {info.tokenizer_hash} but data.tokenizer_hash is {tokenizer_hash}: the tokenizer does not match the data"
        )
    if verify_checksum:
        actual = file_sha256(path)
        if actual != info.sha256:
            raise TokenDataError(f"{path}: sha256 {actual} does not match the sidecar's {info.sha256}: corrupt file")
        if info.num_tokens:  # read in full for the checksum anyway: ids must fit the vocabulary
            top = int(np.memmap(path, dtype=dtype, mode="r", shape=(info.num_tokens,)).max())
            if top >= info.vocab_size:
                raise TokenDataError(f"{path}: token id {top} is outside the vocabulary of {info.vocab_size} (its sidecar)")
    if info.num_tokens == 0:
        return np.zeros(0, dtype=dtype), info
    return np.memmap(path, dtype=dtype, mode="r", shape=(info.num_tokens,)), info
