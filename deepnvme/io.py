"""File writers that take torch.save's bytes to disk through an aio_handle with O_DIRECT.

`FastFileWriter` / `FastFileWriterConfig` have DeepSpeed's `deepspeed.io` interface, so code written for
DeepSpeed works with only its import changed (`PyFileWriter` and `MockFileWriter` come along, since
DeepSpeed's writer factory imports all four). Beneath them is the O_DIRECT writer of the private core
(:class:`deepnvme._core.direct.AlignedWriter`), which `deepnvme.save` shares: it places bytes at file
offsets, sends every whole page through the handle (O_DIRECT, asynchronously) and writes only the partial
pages at the ends of a run through the page cache. No page is ever written both ways, because the kernel
cannot keep such a page coherent.

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

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.checks import check_int, check_type
from deepnvme._core.direct import AlignedWriter, close_pair, open_for_write
from deepnvme._core.errors import with_path
from deepnvme._core.memory import PAGE, byte_view, memory_of

__all__ = ["BaseFileWriter", "FastFileWriter", "FastFileWriterConfig", "MockFileWriter", "PyFileWriter",
           "STRIPE_BYTES"]

# Bytes per stripe in the parallel-writers mode; every writer of a file must use the same value.
STRIPE_BYTES = 8 << 20


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

    dnvme_handle: AioHandle
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
        n = check_int("num_parallel_writers", config.num_parallel_writers)
        rank = check_int("writer_rank", config.writer_rank, 0, n - 1)
        buffers = _staging_halves(config.pinned_tensor, 2 if config.double_buffer else 1)
        self._num_parallel_writers, self._writer_rank = n, rank
        self._global_rank = config.global_rank
        self._dnvme_handle = config.dnvme_handle
        # DeepSpeed's factory names a data-parallel writer's own file "<path>-<rank>.<n>": the whole stream.
        own_file = n > 1 and self._file_path.endswith(f"-{rank}.{n}")
        self._shares = _Shares() if own_file else _Shares(n, rank)
        self._partition_own_file = own_file
        self._direct_fd, self._buffered_fd = open_for_write(self._file_path, os.O_CREAT)
        self._writer = AlignedWriter(config.dnvme_handle, self._direct_fd, self._buffered_fd, buffers)
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
            raise with_path(exc, self._file_path) from exc
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
                    self._writer.put(memory_of(part), base + a, part)
                at += piece.numel()
        except OSError as exc:
            raise with_path(exc, self._file_path) from exc
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
                raise with_path(exc, self._file_path) from exc
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

    check_type("pinned_tensor", pinned, torch.Tensor)
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
