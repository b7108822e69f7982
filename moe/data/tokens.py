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
from pathlib import Path

import numpy as np

from moe.digest import sha256_file as file_sha256  # moe.data's name for it
from moe.errors import TokenDataError  # noqa: F401 - raised here, defined with every other error
from moe.reader import FileFormatError, Int, Map, Nullable, Str, read_json

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


SIDECAR_LIMIT = 1 << 20  # ours are a few hundred bytes
TOKEN_ID = Int(0, 2**32 - 1)
# The sidecar as write_token_file writes it (dataclasses.asdict(TokenFileInfo)); a field of
# TokenFileInfo with a default may be absent (sidecars written before it existed).
SIDECAR_SCHEMA = Map(
    required={
        "dtype": Str(16, choices=tuple(_DTYPES)),
        "vocab_size": Int(1, 2**32),
        "eos_id": TOKEN_ID,
        "pad_id": Nullable(TOKEN_ID),
        "tokenizer_hash": Nullable(Str(256)),
        "num_tokens": Int(0, 2**53),
        "sha256": Str(64, r"[0-9a-f]{64}"),
    },
    optional={"num_documents": Nullable(Int(0, 2**53)), "format": Str(64, choices=(FORMAT,))},
)


def read_sidecar(path: str | os.PathLike) -> TokenFileInfo:
    side = sidecar_path(path)
    if not Path(path).is_file():
        raise TokenDataError(f"{path}: token file not found")
    if not side.exists():
        raise TokenDataError(f"{path}: sidecar {side.name} not found (was the file written by `moe tokenize`?)")
    try:
        info = TokenFileInfo(**read_json(side, SIDECAR_SCHEMA, SIDECAR_LIMIT))
    except FileFormatError as exc:
        raise TokenDataError(str(exc)) from None
    problem = _sidecar_problem(info)
    if problem:
        raise TokenDataError(f"{side}: {problem}")
    return info


def _sidecar_problem(info: TokenFileInfo) -> str | None:
    """What is wrong between a sidecar's fields (SIDECAR_SCHEMA checked each alone), or None."""
    if dtype_for_vocab(info.vocab_size) == "uint32" and info.dtype == "uint16":
        return f"dtype uint16 cannot hold vocab_size {info.vocab_size}"
    for name in ("eos_id", "pad_id"):
        v = getattr(info, name)
        if v is not None and v >= info.vocab_size:
            return f"{name} {v!r} is not a token id below vocab_size {info.vocab_size}"
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
