"""The O_DIRECT writer: bytes placed at file offsets, whole pages through an aio_handle, the rest buffered.

Also the one rule for "did this file system refuse O_DIRECT, and what then?" (:data:`O_DIRECT_REFUSED`:
open it buffered, warn once per file system), which every Python opener of the project follows (save, the
DCP backend, FastFileWriter, the swap space, the tools), and the openers themselves.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.files import close_all, mount_of, open_into
from deepnvme._core.memory import PAGE, memory_of, round_up
from op_builder.atomic_file import replaced_by

__all__ = ["DIRECT_MIN_BYTES", "O_DIRECT_REFUSED", "AlignedWriter", "close_pair",
           "note_o_direct_refused", "o_direct_refused", "open_direct", "open_for_write", "open_maybe_direct"]

# Below this a caller's block is copied into the staging buffer rather than written on its own.
DIRECT_MIN_BYTES = 256 << 10
# The rule, for every opener in the project (the C++ handle's is csrc/aio/file.h's
# o_direct_refused_errno, and tests/aio/test_core.py holds the two to the same set): an open with
# O_DIRECT failing with one of these errors means the file system does not do direct I/O there, and the
# file is opened again without it, with one RuntimeWarning per file system and process. EINVAL is what
# Linux itself answers (ramfs, tmpfs before Linux 6.6, FUSE and overlay mounts over such file systems);
# EOPNOTSUPP is what file systems that check the flag in their own open answer (some network and FUSE
# file systems). Any other error is about the file, not the mode, and is raised.
O_DIRECT_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP})


def o_direct_refused(exc: OSError) -> bool:
    """True when ``exc`` from an open with O_DIRECT means the file system refuses direct I/O."""
    return exc.errno in O_DIRECT_REFUSED


_noticed: set[tuple[int, str]] = set()
_noticed_lock = threading.Lock()


def note_o_direct_refused(path: str | os.PathLike[str], fd: int, stacklevel: int = 2) -> None:
    """Warn (RuntimeWarning) that the file system of ``path`` (open as ``fd``) refused O_DIRECT: once per
    file system, named by device and mount point (a remount is a new one), per process. The C++ handle
    words its own notice the same (csrc/aio/handle.cpp)."""
    mount = mount_of(path)[0] or os.path.dirname(os.path.abspath(path))
    cause = (os.fstat(fd).st_dev, mount)
    with _noticed_lock:
        if cause in _noticed:
            return
        _noticed.add(cause)
    shown = replaced_by(os.fspath(path))  # a save's temporary: the name the caller gave
    warnings.warn(f"O_DIRECT is not supported by the file system mounted at {mount} (first seen with "
                  f"{shown}); deepnvme uses buffered I/O there: correct, but through the page cache",
                  RuntimeWarning, stacklevel=stacklevel + 1)


def open_maybe_direct(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> tuple[int, bool]:
    """Open ``path`` with O_DIRECT, or, where the file system refuses it (:data:`O_DIRECT_REFUSED`), without
    and with the notice of :func:`note_o_direct_refused`. Returns (descriptor, whether it is O_DIRECT).

    O_CLOEXEC is added. Linux creates a file before it refuses O_DIRECT, so the second open drops O_EXCL:
    the refusal means the exclusive create succeeded, and the file it finds is ours.
    """
    flags |= os.O_CLOEXEC
    held: list[int] = []  # closed if an interrupt comes before the return (see open_into)
    try:
        try:
            return open_into(held, path, flags | os.O_DIRECT, mode), True
        except OSError as exc:
            if not o_direct_refused(exc):
                raise
        fd = open_into(held, path, flags & ~os.O_EXCL, mode)
        note_o_direct_refused(path, fd, stacklevel=3)
        return fd, False
    except BaseException:
        close_all(held)
        raise


def open_direct(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int:
    """The descriptor of :func:`open_maybe_direct` (the handle buffers where it is not O_DIRECT)."""
    return open_maybe_direct(path, flags, mode)[0]


def open_for_write(path: str, flags: int = 0, mode: int = 0o666) -> tuple[int, int]:
    """Open `path` for writing twice: (O_DIRECT descriptor, buffered descriptor).

    Where the file system refuses O_DIRECT (see :func:`o_direct_refused`), both are the same buffered
    descriptor, the handle does plain writes (slower, still correct) and :func:`note_o_direct_refused`
    warns.
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
            note_o_direct_refused(path, buffered, stacklevel=2)
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
        mem = round_up(self._fill) + offset % PAGE
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
        head_end = min(end, round_up(start))
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
