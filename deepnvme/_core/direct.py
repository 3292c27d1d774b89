"""The O_DIRECT writer: bytes placed at file offsets, whole pages through an aio_handle, the rest buffered.

Also the one answer to "did this file system refuse O_DIRECT?", which every opener here and in the tools
asks, and the openers themselves.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.files import close_all, open_into
from deepnvme._core.memory import PAGE, memory_of

__all__ = ["DIRECT_MIN_BYTES", "O_DIRECT_REFUSED", "AlignedWriter", "close_pair", "o_direct_refused",
           "open_direct", "open_for_write"]

# Below this a caller's block is copied into the staging buffer rather than written on its own.
DIRECT_MIN_BYTES = 256 << 10
# The errors open(O_DIRECT) gives where the file system does not do direct I/O: EINVAL (tmpfs before Linux
# 6.6, ramfs, some FUSE mounts) or EOPNOTSUPP (some network and overlay file systems). Any other error is
# about the file, not the mode, and is raised.
O_DIRECT_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP})


def o_direct_refused(exc: OSError) -> bool:
    """True when ``exc`` from an open with O_DIRECT means the file system refuses direct I/O."""
    return exc.errno in O_DIRECT_REFUSED


def open_direct(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int:
    """Open with O_DIRECT where the file system allows it; else plainly (the handle then buffers)."""
    direct = getattr(os, "O_DIRECT", 0)
    held: list[int] = []  # closed if an interrupt comes before the return (see open_into)
    try:
        if direct:
            try:
                return open_into(held, path, flags | direct, mode)
            except OSError as exc:
                if not o_direct_refused(exc):
                    raise
        return open_into(held, path, flags, mode)
    except BaseException:
        close_all(held)
        raise


def open_for_write(path: str, flags: int = 0, mode: int = 0o666) -> tuple[int, int]:
    """Open `path` for writing twice: (O_DIRECT descriptor, buffered descriptor).

    Where the file system refuses O_DIRECT (see :func:`o_direct_refused`), both are
    the same buffered descriptor and the handle does plain writes: slower, still correct.
    """
    base = os.O_WRONLY | os.O_CLOEXEC | flags
    held: list[int] = []  # what is open so far, closed if this fails (a KeyboardInterrupt too: open_into)
    try:
        buffered = open_into(held, path, base, mode)
        try:
            direct = open_into(held, path, (base & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | os.O_DIRECT)
        except OSError as exc:
            if not o_direct_refused(exc):
                raise
            direct = buffered
    except BaseException:
        close_all(held)
        raise
    return direct, buffered


def close_pair(direct: int, buffered: int) -> None:
    """Close what open_for_write returned (once each; both, whatever interrupts: see close_all)."""
    close_all([fd for fd in dict.fromkeys((direct, buffered)) if fd >= 0])


class AlignedWriter:
    """Places bytes at file offsets: whole pages through the handle (async), partial pages buffered.

    Small pieces are copied into page-aligned staging buffers, kept at the same offset modulo PAGE as
    their file position so that every staged page can go O_DIRECT. A piece with a `source` tensor whose
    memory outlives the writer's next wait() is written from that memory without a copy. Two staging
    buffers let one fill while the other is on its way; since the handle's wait() completes every queued
    request, reusing a buffer waits for all of them.
    """

    def __init__(self, handle: AioHandle, direct_fd: int, buffered_fd: int, buffers: list[Any]) -> None:
        self._handle = handle
        self._direct_fd = direct_fd
        self._buffered_fd = buffered_fd
        self._bufs = buffers
        self._mems = [memory_of(b) for b in buffers]
        self._busy = [False] * len(buffers)
        self._cur = 0
        self._fill = 0  # next free byte of the current buffer
        self._seg_mem = 0  # where the open run starts in the current buffer
        self._seg_file = 0  # the file offset of that byte
        self._keep: list[Any] = []  # tensors whose memory queued writes read
        self._queued = 0
        self.end = 0  # one past the last byte placed
        self.bytes_direct = 0
        self.bytes_staged = 0
        self.bytes_buffered = 0

    def put(self, view: memoryview, offset: int, source: Any = None) -> None:
        """Write `view`'s bytes at `offset`; `source`, if given, is a uint8 tensor over the same memory."""
        n = len(view)
        if n == 0:
            return
        if offset != self._seg_file + (self._fill - self._seg_mem):
            self._issue()
            self._start_run(offset)
        if source is not None and n >= DIRECT_MIN_BYTES and offset % PAGE == 0:
            body = n - n % PAGE
            self._issue()  # the run so far ends on a page boundary here
            self._queue(source[:body], offset)
            self._keep.append(source)
            self.bytes_direct += body
            self._start_run(offset + body)
            view, offset = view[body:], offset + body
        self._stage(view)
        self.end = max(self.end, offset + len(view))

    def finish(self) -> int:
        """Write what is staged, wait for everything; returns one past the last byte placed."""
        self._issue()
        self.wait()
        return self.end

    def wait(self) -> None:
        """Complete every queued write (raises the handle's OSError if one failed)."""
        if self._queued:
            self._queued = 0
            try:
                self._handle.wait()
            finally:
                self._busy = [False] * len(self._bufs)
                self._keep.clear()

    def abandon(self) -> None:
        """After an error: let queued writes finish (their memory must outlive them), ignore their errors."""
        try:
            self.wait()
        except OSError:
            pass

    def _queue(self, tensor: Any, offset: int) -> None:
        self._handle.async_pwrite(tensor, self._direct_fd, offset)
        self._queued += 1

    def _stage(self, view: memoryview) -> None:
        size = len(self._mems[self._cur])
        while len(view):
            if self._fill == size:
                self._issue()
                self._next_buffer(self._seg_file)
            k = min(size - self._fill, len(view))
            self._mems[self._cur][self._fill:self._fill + k] = view[:k]
            self._fill += k
            self.bytes_staged += k
            view = view[k:]

    def _start_run(self, offset: int) -> None:
        """Open a new run for file `offset` at the next position congruent to it modulo PAGE."""
        mem = -(-self._fill // PAGE) * PAGE + offset % PAGE
        if mem >= len(self._mems[self._cur]):
            self._next_buffer(offset)
            return
        self._fill = self._seg_mem = mem
        self._seg_file = offset

    def _next_buffer(self, offset: int) -> None:
        self._cur = (self._cur + 1) % len(self._bufs)
        if self._busy[self._cur]:
            self.wait()
        self._fill = self._seg_mem = offset % PAGE
        self._seg_file = offset

    def _issue(self) -> None:
        """Send the open run: its partial first and last pages buffered, the pages between O_DIRECT."""
        n = self._fill - self._seg_mem
        if n <= 0:
            return
        mem, start, end = self._seg_mem, self._seg_file, self._seg_file + n
        head_end = min(end, -(-start // PAGE) * PAGE)
        body_end = max(head_end, end - end % PAGE)
        if head_end > start:
            self._pwrite(mem, start, head_end)
        if body_end > head_end:
            at = mem + head_end - start
            self._queue(self._bufs[self._cur][at:at + body_end - head_end], head_end)
            self._busy[self._cur] = True
        if end > body_end:
            self._pwrite(mem + body_end - start, body_end, end)
        self._seg_mem, self._seg_file = self._fill, end

    def _pwrite(self, mem: int, start: int, end: int) -> None:
        self.bytes_buffered += end - start
        view = self._mems[self._cur][mem:mem + end - start]
        while len(view):
            done = os.pwrite(self._buffered_fd, view, start)
            view, start = view[done:], start + done
