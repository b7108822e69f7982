"""sha256 of a file, read in 4 MiB blocks: the one digest of files (token files, checkpoints,
outputs' ledgers and records) everything here writes and checks."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
