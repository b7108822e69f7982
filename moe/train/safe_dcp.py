"""Reading DCP checkpoints without executing code from them.

DCP stores its ``.metadata`` as a pickle and loads it with ``pickle.load``: a planted file runs
whatever it names. And a metadata entry of kind ``BytesStorageMetadata`` makes DCP's default
planner ``torch.load(..., weights_only=False)`` the bytes it points to: a second way in.
Checkpoints come from other people (shared runs, converted models), so:

- the metadata is read with an unpickler that resolves only the plain classes DCP itself
  writes for tensors (its metadata dataclasses, torch dtypes and sizes); anything else,
  ``BytesStorageMetadata`` included, is refused with the file's name;
- every entry must describe a tensor (our checkpoints hold nothing else; the save side
  refuses other values), and every storage location must be a plain file of the checkpoint;
- the load planner refuses bytes outright, so no path reaches an unrestricted ``torch.load``
  even if the checks above were bypassed. Tensor data itself is read with ``weights_only``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

_MODULES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # storage_meta.checkpoint_id
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
        raise UnsafeCheckpointError(f"refers to {module}.{name}, which a checkpoint of tensors never holds")


def read_metadata(path: str | Path) -> Metadata:
    """A DCP ``.metadata`` file describing tensors stored in plain files beside it, or
    UnsafeCheckpointError / pickle errors when it is not one."""
    path = Path(path)
    metadata = _Restricted(io.BytesIO(path.read_bytes())).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise UnsafeCheckpointError("its state_dict_metadata is not a mapping")
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(f"entry {str(key)[:80]!r} is a {type(entry).__name__}, not a tensor")
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError("its storage_data is not a mapping")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UnsafeCheckpointError(f"names storage {str(name)[:80]!r} outside the checkpoint directory")
        if (path.parent / name).is_symlink():
            raise UnsafeCheckpointError(f"its storage file {name} is a symlink")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the restricted unpickler and checks."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path) / ".metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but bytes are refused instead of being unpickled without restriction."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn!r} is stored as pickled bytes, not a tensor")
