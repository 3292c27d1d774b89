"""The aio_handle the DCP writer and reader do their I/O with: the one given, one made from the settings
given (checked when the writer or reader is made, not mid-save), or the calling thread's checkpoint handle
for the directory; how it is drained on the way out of a failure; and how much copying may run ahead of it.
"""

from __future__ import annotations

from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.handles import CHECKPOINT, check_settings, checkpoint_handle, new_handle

# Bytes of temporary copies (device tensors, views, resharding) allowed in flight before draining the handle.
COPY_AHEAD = 256 << 20


def _handle_settings(handle: AioHandle | None, given: dict[str, Any]) -> dict[str, Any]:
    """The settings of a handle of our own, checked up front so a bad value fails at construction, not
    mid-save; empty when `handle` is passed or nothing is set (then each thread's checkpoint handle serves).
    Settings left out are the checkpoint defaults (deepnvme._core.handles.CHECKPOINT)."""
    if handle is not None or all(v is None for v in given.values()):
        return {}
    return check_settings(given, CHECKPOINT)


def _resolve_handle(handle: AioHandle | None, settings: dict[str, Any], directory: str) -> AioHandle:
    """The handle given, else one made from `settings` (kept by the caller), else this thread's checkpoint
    handle for `directory` (its tuned settings where it has them, see checkpoint_settings)."""
    if handle is not None:
        return handle
    return new_handle(**settings) if settings else checkpoint_handle(directory)


class HandleChoice:
    """The `handle` property of AioStorageWriter and AioStorageReader, and the settings behind it."""

    path: Any  # the checkpoint directory (FileSystemWriter's and FileSystemReader's)

    def _choose_handle(self, handle: AioHandle | None, block_size: int | None, queue_depth: int | None,
                       intra_op_parallelism: int | None, engine: str | None) -> None:
        """Keep `handle`, or the checked settings of a handle of our own (see _handle_settings)."""
        self._handle_settings = _handle_settings(handle, {
            "block_size": block_size, "queue_depth": queue_depth,
            "intra_op_parallelism": intra_op_parallelism, "engine": engine})
        self._handle = handle

    @property
    def handle(self) -> AioHandle:
        """The handle given; else one made once from the settings given; else the calling thread's
        checkpoint handle for this directory (async_save writes from a thread of its own)."""
        if self._handle is None and self._handle_settings:
            self._handle = _resolve_handle(None, self._handle_settings, str(self.path))
        return _resolve_handle(self._handle, {}, str(self.path))


def drain_quietly(handle: AioHandle) -> None:
    """Let every queued request finish before buffers are freed; the first error is already being raised."""
    try:
        handle.wait()
    except Exception:  # noqa: BLE001 - the error that brought us here is the one to report
        pass
