"""Fixed-length training sequences over many token files.

Each file is cut into non-overlapping windows of ``seq_len + 1`` tokens that share their edge
token, so every token but a file's first is predicted exactly once: window i holds tokens
[i*seq_len, (i+1)*seq_len]. Inputs are the first seq_len tokens, labels the last seq_len.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import torch

from moe.data.tokens import TokenDataError, TokenFileInfo, open_token_file


def resolve_paths(patterns: list[str]) -> list[Path]:
    """Files, directories (their ``*.npy``) or globs -> sorted unique token files."""
    files: list[Path] = []
    for pattern in patterns:
        p = Path(pattern)
        if p.is_dir():
            matches = sorted(p.glob("*.npy"))
        elif any(ch in pattern for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True) if m.endswith(".npy"))
        else:
            matches = [p]
        if not matches:
            raise TokenDataError(f"{pattern}: no token files (*.npy) found")
        files.extend(matches)
    seen: set[str] = set()
    unique = []
    for f in files:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


class TokenDataset:
    def __init__(
        self,
        paths: list[str],
        seq_len: int,
        *,
        tokenizer_hash: str | None = None,
        verify_checksums: bool = True,
    ) -> None:
        if not paths:
            raise TokenDataError("data.paths: no token files given")
        self.seq_len = seq_len
        self.files = resolve_paths(paths)
        self.arrays: list[np.ndarray] = []
        self.infos: list[TokenFileInfo] = []
        for f in self.files:
            arr, info = open_token_file(f, verify_checksum=verify_checksums, tokenizer_hash=tokenizer_hash)
            self.arrays.append(arr)
            self.infos.append(info)
        vocab = {i.vocab_size for i in self.infos}
        if len(vocab) > 1:
            raise TokenDataError(f"{self.files[0]}: token files disagree on vocab_size ({sorted(vocab)})")
        self.vocab_size = vocab.pop()
        counts = [max(0, (len(a) - 1) // seq_len) for a in self.arrays]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self._starts[-1] == 0:
            raise TokenDataError(
                f"{self.files[0]}: the token files hold no sequence of {seq_len + 1} tokens "
                f"({sum(len(a) for a in self.arrays)} tokens in {len(self.files)} files)"
            )

    @property
    def eos_id(self) -> int:
        return self.infos[0].eos_id

    def __len__(self) -> int:
        return int(self._starts[-1])

    def window(self, index: int) -> np.ndarray:
        f = int(np.searchsorted(self._starts, index, side="right") - 1)
        start = (index - int(self._starts[f])) * self.seq_len
        return self.arrays[f][start : start + self.seq_len + 1]

    def batch(self, indices: np.ndarray) -> torch.Tensor:
        """[len(indices), seq_len + 1] int64 tokens."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            out[row] = self.window(int(index))
        return torch.from_numpy(out)
