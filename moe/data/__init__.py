"""Token data: OLMo-core token files with sidecars, fixed-length sequences, resumable loader."""

from moe.data.dataset import TokenDataset, resolve_paths
from moe.data.loader import BatchLoader, LoaderState
from moe.data.tokens import (
    TokenDataError,
    TokenFileInfo,
    dtype_for_vocab,
    file_sha256,
    open_token_file,
    read_sidecar,
    write_token_file,
)

__all__ = [
    "BatchLoader",
    "LoaderState",
    "TokenDataError",
    "TokenDataset",
    "TokenFileInfo",
    "dtype_for_vocab",
    "file_sha256",
    "open_token_file",
    "read_sidecar",
    "resolve_paths",
    "write_token_file",
]
