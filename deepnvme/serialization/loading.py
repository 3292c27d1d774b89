"""deepnvme.load: the archive read by the handles (archive_reader, prefetch), then torch.load over it, and
every error torch raises about the file turned into a CheckpointFormatError naming it."""

from __future__ import annotations

import os
import pickle
from typing import Any

from deepnvme._core import zipformat
from deepnvme._core.aio_types import AioHandle
from deepnvme._core.checks import check_path
from deepnvme._core.errors import CheckpointFormatError, RefusedPickle, with_path
from deepnvme._core.files import open_regular
from deepnvme._core.handles import checkpoint_handle
from deepnvme._core.interrupts import interruption, interrupts_noted
from deepnvme.serialization.archive_reader import ArchiveReader
from deepnvme.serialization.read_errors import Mispredicted


def load(path: str | os.PathLike, map_location: Any = None, weights_only: bool = True, *,
         handle: AioHandle | None = None,
         verify: bool = True, mmap: bool = False, pickle_module: Any = None, **pickle_load_args: Any) -> Any:
    """torch.load(path, map_location, weights_only=...) with each payload read by the handle into its tensor.

    Reads any torch.save file: archives from deepnvme.save or torch.save (payloads 64-byte aligned there;
    each is read into memory placed at the same offset from a page, so it still goes O_DIRECT), legacy
    non-zip files (through plain torch.load). `verify` checks the records' CRC-32. `mmap=True` is
    torch.load's memory-mapped path unchanged. A file that is truncated, damaged or not a torch checkpoint
    raises CheckpointFormatError naming it.
    """
    path = check_path("path", path)
    kwargs = dict(pickle_load_args, map_location=map_location, weights_only=weights_only)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    fd = open_regular(path)  # a FIFO or device is refused here, without blocking
    try:
        restore = None if mmap else _restore_location(map_location)
        records = zipformat.read_records(fd, path, exact=restore is None)
        if mmap:  # torch's memory-mapped path: torch maps the file by its name
            return _torch_load(path, path, kwargs | {"mmap": mmap})
        if records is None:  # the legacy format: torch reads it, from the file opened here
            with os.fdopen(fd, "rb", closefd=False) as f:  # no dup: see zipformat.read_records
                return _torch_load(f, path, kwargs)
        if handle is None:
            where = os.path.dirname(os.path.abspath(path))
            handles = [checkpoint_handle(where), checkpoint_handle(where, 1)]
        else:
            handles = [handle]
        reader = ArchiveReader(fd, path, records, handles[0], verify)
        try:
            if restore is not None:
                try:
                    reader.prefetch(handles)
                except Mispredicted:  # an archive not laid out as torch's writer does: read its headers
                    reader.close()
                    reader = ArchiveReader(fd, path, zipformat.read_records(fd, path), handles[0], verify)
                    reader.prefetch(handles)
                kwargs["map_location"] = reader.substituting(restore)
            result = _torch_load(reader, path, kwargs)
            if reader.error is not None:
                raise reader.error
            return result
        finally:
            reader.close()
    finally:
        os.close(fd)


def _restore_location(map_location: Any) -> Any:
    """torch.load's own function placing each loaded storage where `map_location` says, or None where
    load cannot hand torch its storages (map_location to meta reads nothing; a torch without it)."""
    import torch.serialization as ts

    get = getattr(ts, "_get_restore_location", None)
    is_meta = getattr(ts, "_is_meta_location", None)
    if get is None or is_meta is None or is_meta(map_location):
        return None
    return get(map_location)


def _torch_load(f: Any, path: str, kwargs: dict[str, Any]) -> Any:
    """torch.load, every error it raises about the file turned into CheckpointFormatError naming `path`.

    Whatever torch raises while it reads an archive whose structure read_records accepted comes from the
    file (a pickle naming records that are not there, a record of another size, a member named `..`, a
    damaged pickle): CheckpointFormatError. What is not about the file keeps its type: the caller's
    map_location failing (a CUDA device on a machine without one), MemoryError, KeyboardInterrupt. A
    weights_only refusal stays a pickle.UnpicklingError (stock's type) and is a CheckpointFormatError too.
    """
    import torch

    noted: list[BaseException] = []
    try:
        with interrupts_noted() as noted:
            return torch.load(f, **kwargs)
    except Exception as exc:
        error = getattr(f, "error", None) or (noted[0] if noted else None) or interruption(exc)
        if error is not None:
            raise error from exc
        if _out_of_memory(exc):
            raise MemoryError(f"{path}: out of memory while torch.load made its tensors ({exc})") from exc
        if exc is getattr(f, "restore_error", None) or isinstance(exc, MemoryError) or _about_devices(exc):
            if hasattr(exc, "add_note"):
                exc.add_note(f"while loading {path}")
            raise
        if isinstance(exc, OSError):
            raise with_path(exc, path, "reading") from exc
        if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
            raise RefusedPickle(path, str(exc)) from exc
        problem = f"damaged or not a torch checkpoint ({type(exc).__name__}: {exc})"
        raise CheckpointFormatError(path, problem) from exc


def _out_of_memory(exc: Exception) -> bool:
    """torch's CPU allocator failing: it raises a plain RuntimeError, which must not read as a damaged
    file (the file is intact). A device's OutOfMemoryError keeps its type (see _about_devices)."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _about_devices(exc: Exception) -> bool:
    """torch's errors for a map_location this machine cannot serve (no CUDA, no such device, out of its
    memory)."""
    import torch

    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True  # out of the device's memory: not the file's fault either
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("is_available() is False" in text
                                              or "Attempting to deserialize object on" in text)
