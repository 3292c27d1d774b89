"""A DCP checkpoint's index: the `.metadata` file read with a restricted unpickler (stock DCP unpickles it in
full, so a crafted one runs code) and written by atomic replace; every storage location it names checked to
lie inside the checkpoint directory; and the data files the directory holds."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from deepnvme._core.errors import CheckpointFormatError
from deepnvme._core.files import atomic_target, open_regular

# The globals a `.metadata` pickle may name: DCP's metadata classes and what they hold (see
# _MetadataUnpickler). AioStorageReader.METADATA_GLOBALS starts from this; a subclass may add to it.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's table of them
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
})


def read_metadata(path: str, directory: str, allowed: frozenset[tuple[str, str]]) -> Metadata:
    """The metadata at `path` of the checkpoint in `directory`, unpickled naming only the globals `allowed`,
    its storage locations checked; errors say which checkpoint and file are at fault."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, f"no checkpoint directory {directory!r}", directory)
    if not os.path.exists(path):
        raise FileNotFoundError(2, "no DCP checkpoint here: its metadata file is missing", path)
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, allowed).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError,
                IndexError, KeyError, MemoryError, OverflowError, RecursionError) as exc:
            raise CheckpointFormatError(path, f"not a readable DCP metadata file ({type(exc).__name__}: "
                                        f"{exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(path, f"not a readable DCP metadata file (it holds a "
                                    f"{type(metadata).__name__})")
    check_storage_data(metadata.storage_data, path)
    return metadata


def write_metadata(path: str, metadata: Metadata, *, durable: bool) -> None:
    """Write `metadata` to `path` by atomic replace (temporary, fsync when `durable`, rename, directory
    fsync): a crash leaves the old metadata file or the new one, never none."""
    with atomic_target(path, durable=durable) as tmp, open(tmp, "xb") as f:
        pickle.dump(metadata, f)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def check_storage_data(storage_data: Any, path: str) -> None:
    """Every item's file must be a plain name inside the checkpoint directory, at a sane place in it."""
    if not isinstance(storage_data, dict):
        raise CheckpointFormatError(path, f"storage_data is a {type(storage_data).__name__}, not a dict")
    for index, info in storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointFormatError(path, f"item {index}: a {type(info).__name__}, not a storage "
                                        "location")
        rel, fqn = info.relative_path, getattr(index, "fqn", index)
        if (not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel)
                or ".." in rel.replace("\\", "/").split("/")):
            raise CheckpointFormatError(path, f"item {fqn!r} names the file {rel!r}, which is not inside the "
                                        "checkpoint directory")
        places = (info.offset, info.length)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in places):
            raise CheckpointFormatError(path, f"item {fqn!r}: offset {info.offset!r} and length "
                                        f"{info.length!r} must be non-negative ints")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a `.metadata` file naming only the allowed globals: DCP's metadata classes, the types their
    fields hold, and torch's dtypes (any attribute of torch that is a torch.dtype). Anything else (a
    function to call, another class) raises UnpicklingError before it is looked up."""

    def __init__(self, f: Any, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(f)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata types; AioStorageReader "
                                     "reads metadata with a restricted unpickler (see its METADATA_GLOBALS)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent references")


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The data files of a DCP checkpoint directory (both writers name them alike), sorted."""
    return sorted(Path(path).glob(f"__*{DEFAULT_SUFFIX}"))
