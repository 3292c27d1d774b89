"""The first interface to torch.save/torch.load through an aio_handle, kept for its callers (ds_io).

save() and load() now go to deepnvme.save / deepnvme.load (atomic, payloads written and read in place);
HandleWriter (a stream that copies everything through two locked buffers) remains for the legacy non-zip
format, which deepnvme.save does not write, and for code that uses it directly.
"""

from __future__ import annotations

import io
from typing import Any

from deepnvme.files import SeekableReader, fsync_path


class HandleWriter(io.RawIOBase):
    """Write-only stream whose bytes reach `path` through `handle` in `chunk`-byte locked buffers."""

    def __init__(self, handle: Any, path: str, chunk: int = 64 << 20, buffers: list | None = None) -> None:
        import torch

        super().__init__()
        if buffers is None and chunk <= 0:
            raise ValueError(f"chunk must be positive, got {chunk}")
        self._handle = handle
        self._path = path
        # Callers that save often pass their own two buffers (see new_buffers) so nothing is locked per save.
        self._owned = buffers is None
        if buffers is None:
            buffers = new_buffers(handle, chunk)
        if len(buffers) != 2 or buffers[0].numel() != buffers[1].numel() or buffers[0].dtype != torch.uint8:
            raise ValueError("buffers must be two uint8 tensors of the same size")
        self._buffers = list(buffers)
        self._views = [memoryview(b.numpy()) for b in self._buffers]
        self._current = 0
        self._fill = 0
        self._offset = 0  # file offset of the current buffer's first byte
        self._pending = False
        # The handle never truncates (pwrite semantics); a shorter archive must not keep an old tail.
        with open(path, "wb"):
            pass

    def writable(self) -> bool:
        """A write-only stream."""
        return True

    def write(self, data: Any) -> int:
        """Copy `data` into the current buffer, handing full buffers to the handle."""
        view = memoryview(data).cast("B")
        done = 0
        size = len(self._views[0])
        while done < len(view):
            n = min(size - self._fill, len(view) - done)
            self._views[self._current][self._fill:self._fill + n] = view[done:done + n]
            self._fill += n
            done += n
            if self._fill == size:
                self._flush_buffer()
        return done

    def tell(self) -> int:
        """Bytes written so far (torch's zip writer asks)."""
        return self._offset + self._fill

    def _flush_buffer(self) -> None:
        """Queue the current buffer and switch to the other, waiting for its earlier write first."""
        if self._fill == 0:
            return
        if self._pending:
            self._handle.wait()  # the other buffer must be on the file before it is reused
        buf = self._buffers[self._current]
        self._handle.async_pwrite(buf[: self._fill], self._path, self._offset)
        self._pending = True
        self._offset += self._fill
        self._fill = 0
        self._current ^= 1

    def close(self) -> None:
        """Write what is left, wait for every write, release the locked buffers."""
        if self.closed:
            return
        try:
            self._flush_buffer()
            if self._pending:
                self._handle.wait()
                self._pending = False
        finally:
            if self._owned:
                for b in self._buffers:
                    self._handle.free_cpu_locked_tensor(b)
            self._buffers, self._views = [], []
            super().close()


def new_buffers(handle: Any, chunk: int) -> list:
    """Two locked uint8 buffers of `chunk` bytes for HandleWriter; free them with free_cpu_locked_tensor."""
    import torch

    example = torch.empty(0, dtype=torch.uint8)
    return [handle.new_cpu_locked_tensor(chunk, example) for _ in range(2)]


class MemoryReader(SeekableReader):
    """A seekable read-only stream over a uint8 tensor, so torch.load copies the bytes only once."""

    def __init__(self, data: Any) -> None:
        view = memoryview(data.numpy()).cast("B")
        super().__init__(len(view))
        self._view = view

    def readinto(self, buffer: Any) -> int:
        """Copy the next bytes into `buffer`."""
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def save(obj: Any, path: str, handle: Any, chunk: int = 64 << 20, legacy: bool = False,
         fsync: bool = True, buffers: list | None = None) -> None:
    """torch.save(obj) to `path` through `handle`: deepnvme.save (atomic, fsynced), or with `legacy` the
    non-zip format streamed through HandleWriter's `chunk`-byte buffers (or the caller's `buffers`)."""
    import torch

    if not legacy:
        from deepnvme.serialization import save as save_archive

        save_archive(obj, path, handle=handle)
        return
    with HandleWriter(handle, path, chunk, buffers) as writer:
        torch.save(obj, writer, _use_new_zipfile_serialization=False)
    if fsync:
        fsync_path(path)


def load(path: str, handle: Any, **kwargs: Any) -> Any:
    """deepnvme.load(path, handle=handle, **kwargs): each payload read by the handle into its tensor."""
    from deepnvme.serialization import load as load_archive

    return load_archive(path, handle=handle, **kwargs)
