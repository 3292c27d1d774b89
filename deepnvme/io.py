"""File writers that take torch.save's bytes to disk through an aio_handle with O_DIRECT.

`FastFileWriter` / `FastFileWriterConfig` have DeepSpeed's `deepspeed.io` interface, so code written for
DeepSpeed works with only its import changed (`PyFileWriter` and `MockFileWriter` come along, since
DeepSpeed's writer factory imports all four). Beneath them is `_AlignedWriter`, which `deepnvme.save`
shares: it places bytes at file offsets, sends every whole 4 KiB page through the handle (O_DIRECT,
asynchronously) and writes only the partial pages at the ends of a run through the page cache. No page
is ever written both ways, because the kernel cannot keep such a page coherent.

Parallel writers: with `num_parallel_writers` n > 1, the writers of one file (same path, on any ranks)
each write a share of it. Every rank serialises the same object, so each sees the same byte stream; the
stream is cut into stripes of `STRIPE_BYTES` and rank r writes the stripes i with i % n == r (its own
share is all that reaches the disk from it). `save_torch_storage_object_list` splits its bytes as
DeepSpeed does: one contiguous share per rank, the remainder bytes to the lowest ranks. The file is
complete once every writer has closed (synchronise the ranks, e.g. with a barrier, before reading it).
DeepSpeed's own writer factory gives each data-parallel writer a file of its own, named
`<path>-<writer_rank>.<num_parallel_writers>`; a writer whose path ends like that writes the whole stream
into it, as DeepSpeed's does.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from deepnvme._core.errors import with_path as _with_path

PAGE = mmap.PAGESIZE
# Bytes per stripe in the parallel-writers mode; every writer of a file must use the same value.
STRIPE_BYTES = 8 << 20
# Below this a caller's block is copied into the staging buffer rather than written on its own.
DIRECT_MIN_BYTES = 256 << 10
# Settings of the handle made when none is passed: the fastest plain-tensor settings measured here.
DEFAULT_HANDLE_SETTINGS = {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False,
                           "overlap_events": True, "intra_op_parallelism": 2}

_local = threading.local()


def default_handle(slot: int = 0) -> Any:
    """This thread's aio_handle number `slot` with DEFAULT_HANDLE_SETTINGS, made on first use (the op is
    built once). load keeps a second one (slot 1) so that one batch of reads is queued while the other's
    complete.

    One per thread because a handle's wait() completes every request queued on it: two threads sharing one
    would wait for, and receive the errors of, each other's requests. A forked child makes its own.
    """
    handles = getattr(_local, "handles", None)
    if handles is None or _local.pid != os.getpid():
        handles = _local.handles = {}
        _local.pid = os.getpid()
    handle = handles.get(slot)
    if handle is None:
        from deepnvme import AsyncIOBuilder

        handle = handles[slot] = AsyncIOBuilder().load().aio_handle(**DEFAULT_HANDLE_SETTINGS)
    return handle


def aligned_buffer(nbytes: int) -> Any:
    """A page-aligned uint8 tensor of `nbytes` in anonymous memory: usable for O_DIRECT, not locked.

    Locked memory is capped by RLIMIT_MEMLOCK (often 8 MiB), so staging buffers are plain pages.
    """
    import torch

    if nbytes <= 0:
        raise ValueError(f"buffer size must be positive, got {nbytes}")
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _memory_of(t: Any) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (the caller keeps the tensor alive)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer, to read the address behind a read-only memoryview."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def address_of(view: memoryview) -> int:
    """The address of a buffer's first byte; torch hands its storages to write() as such views."""
    buf = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buf), 0)
    try:
        return buf.buf or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


def open_for_write(path: str, flags: int = 0, mode: int = 0o666) -> tuple[int, int]:
    """Open `path` for writing twice: (O_DIRECT descriptor, buffered descriptor).

    Where the file system refuses O_DIRECT (EINVAL: tmpfs before Linux 6.6, some FUSE mounts), both are
    the same buffered descriptor and the handle does plain writes: slower, still correct.
    """
    base = os.O_WRONLY | os.O_CLOEXEC | flags
    buffered = os.open(path, base, mode)
    try:
        direct = os.open(path, (base & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            os.close(buffered)
            raise
        direct = buffered
    return direct, buffered


def close_pair(direct: int, buffered: int) -> None:
    """Close what open_for_write returned (once each)."""
    if direct != buffered and direct >= 0:
        os.close(direct)
    if buffered >= 0:
        os.close(buffered)


class _AlignedWriter:
    """Places bytes at file offsets: whole pages through the handle (async), partial pages buffered.

    Small pieces are copied into page-aligned staging buffers, kept at the same offset modulo PAGE as
    their file position so that every staged page can go O_DIRECT. A piece with a `source` tensor whose
    memory outlives the writer's next wait() is written from that memory without a copy. Two staging
    buffers let one fill while the other is on its way; since the handle's wait() completes every queued
    request, reusing a buffer waits for all of them.
    """

    def __init__(self, handle: Any, direct_fd: int, buffered_fd: int, buffers: list[Any]) -> None:
        self._handle = handle
        self._direct_fd = direct_fd
        self._buffered_fd = buffered_fd
        self._bufs = buffers
        self._mems = [_memory_of(b) for b in buffers]
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


class _Shares:
    """Which byte ranges of the stream this writer writes: all of them, or its stripes of them."""

    def __init__(self, writers: int = 1, rank: int = 0) -> None:
        self.writers, self.rank = writers, rank

    def owned(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """The pieces of [start, end) that are this writer's."""
        if self.writers == 1:
            if end > start:
                yield start, end
            return
        stripe = start // STRIPE_BYTES
        while stripe * STRIPE_BYTES < end:
            if stripe % self.writers == self.rank:
                yield max(start, stripe * STRIPE_BYTES), min(end, (stripe + 1) * STRIPE_BYTES)
            stripe += 1


@dataclass
class FastFileWriterConfig:
    """DeepSpeed's FastFileWriterConfig: the handle, the staging tensor and the parallel-writer place."""

    dnvme_handle: object
    pinned_tensor: Any
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0


# DeepSpeed's statistics keys, so `_dump_state()` prints what DeepSpeed users read.
_STAT_KEYS = ("close", "fileno", "flush", "write", "bytes", "write_secs", "write_GB/s")
_FAST_STAT_KEYS = ("aio_write_secs", "aio_bytes", "aio_GB/s", "slow_bytes", "slow_write_secs",
                   "fill_buffer_count", "fill_buffer_secs", "fill_buffer_GB/s", "save_storage",
                   "save_storage_bytes")
_STORAGE_SIZE_BYTES = 8  # the int64 element count save_torch_storage_object_list puts before a storage


class BaseFileWriter:
    """DeepSpeed's writer base: a path and a statistics dictionary."""

    def __init__(self, file_path: str) -> None:
        self._file_path = os.fspath(file_path)
        self._stats: dict[str, Any] = dict.fromkeys(_STAT_KEYS, 0)

    def file_path(self) -> str:
        """The path written."""
        return self._file_path

    def close(self) -> None:
        """Nothing to release here."""

    def fileno(self) -> int:
        """-1: torch then treats the writer as a plain stream and only calls write()."""
        self._stats["fileno"] += 1
        return -1

    def flush(self) -> None:
        """Counted only; data reaches the file on close()."""
        self._stats["flush"] += 1

    def _dump_state(self) -> None:
        """Print the statistics as DeepSpeed does (its checkpoint engine calls this when asked to)."""
        if self._stats["write_secs"] > 0:
            self._stats["write_GB/s"] = self._stats["bytes"] / self._stats["write_secs"] / (1 << 30)
        self._stats["path"] = self._file_path
        print(f"stats = {self._stats}")


class PyFileWriter(BaseFileWriter):
    """DeepSpeed's PyFileWriter: plain buffered writes, for comparison."""

    def __init__(self, file_path: str) -> None:
        super().__init__(file_path)
        self._fp = open(self._file_path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, buffer: Any) -> int:
        """Write through Python's buffered file."""
        start = time.perf_counter()
        n = self._fp.write(buffer)
        self._stats["write"] += 1
        self._stats["bytes"] += n
        self._stats["write_secs"] += time.perf_counter() - start
        return n

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._fp.closed:
            self._fp.close()
            self._stats["close"] += 1


class MockFileWriter(BaseFileWriter):
    """DeepSpeed's MockFileWriter: creates the file, counts the bytes, writes nothing."""

    def __init__(self, file_path: str) -> None:
        super().__init__(file_path)
        with open(self._file_path, "wb"):
            pass

    def write(self, buffer: Any) -> int:
        """Count the bytes."""
        n = len(memoryview(buffer).cast("B"))
        self._stats["write"] += 1
        self._stats["bytes"] += n
        return n

    def save_torch_storage_object_list(self, storage_obj_list: list, save_size: bool) -> int:
        """Count the bytes the storages (and their size prefixes) would take."""
        prefix = _STORAGE_SIZE_BYTES if save_size else 0
        n = sum(_untyped(obj).nbytes() + prefix for obj, _ in storage_obj_list)
        self._stats["write"] += 1
        self._stats["bytes"] += n
        return n


def _untyped(storage: Any) -> Any:
    """The UntypedStorage behind a storage object (TypedStorage or UntypedStorage)."""
    import torch

    if isinstance(storage, torch.storage.TypedStorage):
        return storage.untyped()
    if isinstance(storage, torch.UntypedStorage):
        return storage
    raise TypeError(f"expected a torch storage, got {type(storage).__name__}")


def byte_view(storage: Any) -> Any:
    """A uint8 tensor over all of an UntypedStorage's bytes (shares its memory, keeps it alive)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class FastFileWriter(BaseFileWriter):
    """DeepSpeed's FastFileWriter: `torch.save(obj, FastFileWriter(path, config))`, then `close()`.

    Bytes are staged in `config.pinned_tensor` (two halves with `double_buffer`) and written through
    `config.dnvme_handle` with O_DIRECT while the next half fills. Unlike DeepSpeed's, it never leaves an
    older, longer file's tail behind (the file is cut to the bytes written), raises OSError naming the
    path instead of asserting, and closes its descriptors even when a write fails. Not atomic: for that
    use `deepnvme.save`.
    """

    def __init__(self, file_path: str, config: FastFileWriterConfig) -> None:
        super().__init__(file_path)
        self._stats.update(dict.fromkeys(_FAST_STAT_KEYS, 0))
        n, rank = config.num_parallel_writers, config.writer_rank
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_parallel_writers must be a positive int, got {n!r}")
        if not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"writer_rank must be in [0, {n}), got {rank!r}")
        buffers = _staging_halves(config.pinned_tensor, 2 if config.double_buffer else 1)
        self._num_parallel_writers, self._writer_rank = n, rank
        self._global_rank = config.global_rank
        self._dnvme_handle = config.dnvme_handle
        # DeepSpeed's factory names a data-parallel writer's own file "<path>-<rank>.<n>": the whole stream.
        own_file = n > 1 and self._file_path.endswith(f"-{rank}.{n}")
        self._shares = _Shares() if own_file else _Shares(n, rank)
        self._partition_own_file = own_file
        self._direct_fd, self._buffered_fd = open_for_write(self._file_path, os.O_CREAT)
        self._writer = _AlignedWriter(config.dnvme_handle, self._direct_fd, self._buffered_fd, buffers)
        self._pos = 0
        self._closed = False

    def write(self, buffer: Any) -> int:
        """Place the bytes that are this writer's; returns len(buffer) (all of it is accounted for)."""
        if self._closed:
            raise ValueError(f"write to a closed FastFileWriter ({self._file_path})")
        start = time.perf_counter()
        view = memoryview(buffer).cast("B")
        n = len(view)
        try:
            for a, b in self._shares.owned(self._pos, self._pos + n):
                self._writer.put(view[a - self._pos:b - self._pos], a)
        except OSError as exc:
            raise _with_path(exc, self._file_path) from exc
        self._pos += n
        self._stats["write"] += 1
        self._stats["bytes"] += n
        self._stats["write_secs"] += time.perf_counter() - start
        return n

    def tell(self) -> int:
        """The stream position (bytes passed to write so far)."""
        return self._pos

    def save_torch_storage_object_list(self, storage_obj_list: list, save_size: bool) -> int:
        """Write `(storage, dtype)` pairs' bytes, each after its int64 element count if `save_size`.

        With parallel writers each rank writes its contiguous share of these bytes, split as DeepSpeed
        does. Returns the bytes this writer wrote. Storage bytes go straight from the storages' memory.
        """
        import torch

        pieces = []
        for obj, dtype in storage_obj_list:
            storage = _untyped(obj)
            if storage.device.type != "cpu":
                storage = storage.cpu()
            if save_size:
                count = storage.nbytes() // torch._utils._element_size(dtype)
                pieces.append(torch.tensor([count], dtype=torch.int64).view(torch.uint8))
            pieces.append(byte_view(storage))
        total = sum(p.numel() for p in pieces)
        first, last = _partition(total, self._num_parallel_writers, self._writer_rank)
        base = self._pos - first if self._partition_own_file else self._pos
        at = 0
        try:
            for piece in pieces:
                a, b = max(at, first), min(at + piece.numel(), last)
                if a < b:
                    part = piece[a - at:b - at]
                    self._writer.put(_memory_of(part), base + a, part)
                at += piece.numel()
        except OSError as exc:
            raise _with_path(exc, self._file_path) from exc
        self._pos += (last - first) if self._partition_own_file else total
        self._stats["save_storage"] += len(storage_obj_list)
        self._stats["save_storage_bytes"] += last - first
        return last - first

    def close(self) -> None:
        """Write what is staged, set the file's length, fsync, close the descriptors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        start = time.perf_counter()
        try:
            try:
                self._writer.finish()
                # Every writer of a shared file may cut it: all of them write below the stream's end.
                os.ftruncate(self._buffered_fd, self._pos)
                os.fsync(self._buffered_fd)
            except OSError as exc:
                self._writer.abandon()
                raise _with_path(exc, self._file_path) from exc
        finally:
            close_pair(self._direct_fd, self._buffered_fd)
            self._direct_fd = self._buffered_fd = -1
            w = self._writer
            self._stats["aio_bytes"] = w.bytes_direct + w.bytes_staged - w.bytes_buffered
            self._stats["slow_bytes"] = w.bytes_buffered
            self._stats["aio_write_secs"] += time.perf_counter() - start
            self._stats["close"] += 1

    def __enter__(self) -> FastFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A writer dropped unclosed still completes its file, as DeepSpeed's does; nothing can be raised here.
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except OSError:
                pass


def _staging_halves(pinned: Any, parts: int) -> list[Any]:
    """Split the caller's staging tensor into `parts` page-aligned byte buffers of whole pages."""
    import torch

    if not isinstance(pinned, torch.Tensor):
        raise TypeError(f"pinned_tensor must be a torch.Tensor, got {type(pinned).__name__}")
    if pinned.device.type != "cpu" or not pinned.is_contiguous():
        raise ValueError("pinned_tensor must be a contiguous CPU tensor")
    raw = pinned.reshape(-1).view(torch.uint8)
    skip = -pinned.data_ptr() % PAGE
    each = (raw.numel() - skip) // parts // PAGE * PAGE
    if each < PAGE:
        raise ValueError(f"pinned_tensor holds {raw.numel()} bytes; at least {parts * PAGE + skip} are "
                         f"needed ({parts} buffer(s) of a {PAGE}-byte page)")
    return [raw[skip + i * each: skip + (i + 1) * each] for i in range(parts)]


def _partition(total: int, ranks: int, rank: int) -> tuple[int, int]:
    """DeepSpeed's split of `total` bytes: equal shares, one remainder byte each to the lowest ranks."""
    share, extra = divmod(total, ranks)
    first = rank * share + min(rank, extra)
    return first, first + share + (1 if rank < extra else 0)
