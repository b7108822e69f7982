"""Reading DCP checkpoints without executing code from them.

DCP stores its ``.metadata`` as a pickle and loads it with ``pickle.load``: a planted file runs
whatever it names. Checkpoints come from other people (shared runs, converted models), so the
metadata is read with an unpickler that resolves only the plain classes DCP itself writes
(its metadata dataclasses, torch dtypes and sizes, paths); anything else is refused with the
file's name. Tensor data and the bytes entries DCP reads are raw or ``weights_only`` already.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_MODULES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    pass


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _MODULES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"refers to {module}.{name}, which a DCP checkpoint's metadata never holds")


def read_metadata(path: str | Path) -> Metadata:
    """A DCP ``.metadata`` file, or UnsafeCheckpointError / pickle errors when it is not one."""
    data = Path(path).read_bytes()
    metadata = _Restricted(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path) / ".metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata
