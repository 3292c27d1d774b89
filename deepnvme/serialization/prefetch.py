"""load's read of a whole archive ahead of torch.load: each large storage payload into memory of its own
(filled fresh through userfaultfd, staged, or O_DIRECT into place), the rest into one scratch buffer, in
batches alternating between two handles while a worker checks the CRC-32s of the batch before.

The switches and sizes below are read when a load runs, from this module: setting them on
deepnvme.serialization sets them here (see that package's face)."""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepnvme._core import zipformat
from deepnvme._core.aio_types import AioHandle
from deepnvme._core.crc import crc32
from deepnvme._core.errors import with_path
from deepnvme._core.memory import PAGE, Populator, aligned_buffer, memory_of, round_up
from deepnvme._core.op import aio_module
from deepnvme._core.zipformat import Record
from deepnvme.serialization.read_errors import Mispredicted, crc_error, read_failure

# Storage payloads from this size up are read into storages of their own (smaller ones are copied out of
# one scratch buffer): a page of alignment slack is small beside them.
PREFETCH_OWN_BYTES = 64 << 10


# Bytes per batch of load's reads: the CRCs of one batch are checked while the next is read. Smaller
# batches read slower (each hand-over between the two handles thins the disk's queue), larger ones start
# the checking later; of 64 MiB to 512 MiB, this size came closest to the raw read.
BATCH_BYTES = 256 << 20


# The batches shrink towards the end of the file (see _batches: a batch ends once it holds half of what was
# left when it began, but this at least): the CRCs of the last batch are checked after every read has
# ended, and a short last batch leaves little of that work on the clock. Reads are never split, so a file
# that ends in payloads of BATCH_BYTES or more keeps its last one whole.
TAIL_BATCH_BYTES = 16 << 20


# Whether load places each large payload's memory off its file offset's page residue (by STAGED_SHIFT
# bytes), so that the handle reads it through its locked staging pool and its worker threads copy it into
# place, rather than O_DIRECT straight into it. A fresh storage's pages are made by whoever touches them
# first: the O_DIRECT read (in the kernel, one request at a time as each is submitted) or the staging copy
# (in user space, on every worker thread at once, beside the reads). On a VM whose fresh pages are costly
# to fault in, the second is the faster (bench/ckpt_bench.py measures both in the same run); it costs the
# workers' copies in CPU.
STAGE_PAYLOADS = True
STAGED_SHIFT = 64


# Whether load fills its large payloads' new memory through userfaultfd (the op's empty_fresh,
# csrc/aio/fresh_memory.h) where this process may use it: the handle stages the reads and its workers fill
# each page as it is made, so the kernel never zeroes it first, and a page costs one copy, not a fault, a
# zeroing and a copy. The memory is at its file offset's residue (staged all the same) and is plain memory
# again before load returns. Where userfaultfd is unavailable, or with this False, STAGE_PAYLOADS applies.
FILL_FRESH = True


@dataclass
class _Piece:
    """One read of the prefetch: file bytes [offset, offset + tensor's length) into `tensor`."""

    offset: int
    tensor: Any
    batch: int = 0


class Prefetched:
    """The whole archive read into memory by the handles (see ArchiveReader), CRCs checked.

    The file is cut at the page-aligned interior ("body") of every large storage payload: each body is
    read into a storage of the payload's size, new memory that the handle's staged reads fill without its
    pages being zeroed first (FILL_FRESH), or else memory made the usual way and read as STAGE_PAYLOADS
    says; the gaps between bodies (headers, small members, the payloads' partial first and last pages, the
    directory) are read into one page-aligned scratch buffer. The reads go in batches of about BATCH_BYTES,
    alternating between the handles: while one batch is read, the one before it is finished (its payloads'
    partial pages copied in from the gaps, CRCs checked) on a worker thread.
    """

    def __init__(self, fd: int, path: str, size: int, records: dict[int, Record], handles: list[AioHandle],
                 verify: bool) -> None:
        import torch

        self._path = path
        self._fd = fd
        self._size = size
        self._by_name = {r.name.partition("/")[2]: r for r in records.values()}
        ordered = sorted(records.values(), key=lambda r: r.offset)
        large = [r for r in ordered if r.is_storage and r.size >= PREFETCH_OWN_BYTES]
        self._tensors: dict[int, Any] = {}  # offset -> uint8 tensor over the payload's own storage
        pieces: list[_Piece] = []
        gaps: list[tuple[int, int]] = []  # file ranges read into scratch
        at = 0
        new_memory, self._fresh = _payload_memory()
        shift = 0 if self._fresh else STAGED_SHIFT * STAGE_PAYLOADS
        for r in large:
            body_start, body_end = round_up(r.offset), r.end // PAGE * PAGE
            if body_start > at:
                gaps.append((at, body_start))
            try:
                tensor = new_memory(r.size, (r.offset + shift) % PAGE)
            except MemoryError as exc:  # the op's allocation says only std::bad_alloc
                raise MemoryError(f"{path}: out of memory allocating {r.size} bytes for {r.name}") from exc
            self._tensors[r.offset] = tensor
            pieces.append(_Piece(body_start, tensor[body_start - r.offset:body_end - r.offset]))
            at = body_end
        if size > at:
            gaps.append((at, size))
        # Gaps in scratch at page-aligned places (their file offsets are page-aligned too), in file order.
        self._gap_starts = [a for a, _ in gaps]
        self._gap_at: list[tuple[int, int, int]] = []  # (file start, file end, scratch start)
        total = 0
        for a, b in gaps:
            self._gap_at.append((a, b, total))
            total += round_up(b - a)
        self._scratch = aligned_buffer(total, path) if total else torch.empty(0, dtype=torch.uint8)
        self._scratch_mem = memory_of(self._scratch)
        pieces += [_Piece(a, self._scratch[s:s + b - a]) for a, b, s in self._gap_at]
        pieces.sort(key=lambda p: p.offset)
        batches = _batches([p.tensor.numel() for p in pieces])
        for p, batch in zip(pieces, batches):
            p.batch = batch
        # What to finish after each batch: the members whose last byte it read.
        ends = [p.offset + p.tensor.numel() for p in pieces]
        finish: list[list[Record]] = [[] for _ in range(batches[-1] + 1 if batches else 1)]
        for r in ordered:
            if r.size and (verify and r.crc is not None or r.offset in self._tensors or r.header_offset >= 0):
                finish[pieces[bisect.bisect_left(ends, r.end)].batch].append(r)
        self._read(fd, pieces, finish, handles, verify)

    def _read(self, fd: int, pieces: list[_Piece], finish: list[list[Record]], handles: list[AioHandle],
              verify: bool) -> None:
        inflight: collections.deque[tuple[Any, int]] = collections.deque()
        worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deepnvme-load-check")
        checks: list[concurrent.futures.Future[None]] = []
        # Memory made the usual way has its pages faulted in ahead of the reads, beside them (see Populator);
        # memory filled fresh must not be touched before its reads fill it.
        populator = None if self._fresh else Populator(list(self._tensors.values())).start()
        try:
            i = 0
            for batch in range(len(finish)):
                handle = handles[batch % len(handles)]
                if len(inflight) == len(handles):
                    self._complete(inflight, finish, worker, checks, verify)
                    for c in checks:  # a damaged member already found: read no further
                        if c.done():
                            c.result()
                inflight.append((handle, batch))  # before queueing: a refused request still drains the rest
                while i < len(pieces) and pieces[i].batch == batch:
                    handle.async_pread(pieces[i].tensor, fd, pieces[i].offset)
                    i += 1
            while inflight:
                self._complete(inflight, finish, worker, checks, verify)
            for c in checks:
                c.result()
        except BaseException as exc:
            for handle, _ in inflight:  # the reads' memory goes with this object: let them end first
                with contextlib.suppress(Exception):
                    handle.wait()
            if isinstance(exc, (OSError, ValueError)):
                failure = read_failure(exc, self._fd, self._path, self._size)
                if failure is not exc:
                    raise failure from exc
            raise
        finally:
            if populator is not None:
                populator.close()
            worker.shutdown(wait=True, cancel_futures=True)
            if self._fresh:  # every read has ended: plain memory from here on
                settle = aio_module().settle_fresh
                for t in self._tensors.values():
                    settle(t)

    def _complete(self, inflight: collections.deque[tuple[Any, int]], finish: list[list[Record]],
                  worker: Any, checks: list[Any], verify: bool) -> None:
        """Wait for the oldest batch in flight, then hand its members to the worker."""
        handle, batch = inflight[0]
        try:
            handle.wait()
        except OSError as exc:
            inflight.popleft()
            raise with_path(exc, self._path, "reading") from exc
        inflight.popleft()
        checks.append(worker.submit(self._finish, finish[batch], verify))

    def _finish(self, records: list[Record], verify: bool) -> None:
        """Check inferred offsets against the local headers; copy the partial first and last pages of
        each payload in from the gaps; check the CRCs."""
        for r in records:
            if r.header_offset >= 0:
                header = self._gap_view(r.header_offset, zipformat.LOCAL_HEADER_BYTES)
                if header is None or zipformat.data_offset(header, r.header_offset) != r.offset:
                    raise Mispredicted(r.name)
            tensor = self._tensors.get(r.offset)
            if tensor is not None:
                mem = memory_of(tensor)
                head, tail = round_up(r.offset) - r.offset, r.end // PAGE * PAGE - r.offset
                if not (self.copy_out(mem[:head], r.offset) and self.copy_out(mem[tail:], r.offset + tail)):
                    raise RuntimeError(f"{self._path}: the edges of {r.name} were not read (a deepnvme bug)")
            else:
                mem = self._gap_view(r.offset, r.size)
            if verify and r.crc is not None:
                got = crc32(mem)
                if got != r.crc:
                    raise crc_error(self._path, r, got)

    def has_storage(self, record: Record) -> bool:
        return record.offset in self._tensors

    def tensor_of(self, record: Record) -> Any:
        return self._tensors[record.offset]

    def storage_of(self, record: Record) -> Any:
        return self._tensors[record.offset].untyped_storage()

    def member_bytes(self, name: str) -> memoryview | None:
        """The bytes of member <archive>/`name` when it lies in the gaps (small members do), else None."""
        r = self._by_name.get(name)
        return None if r is None else self._gap_view(r.offset, r.size)

    def copy_out(self, view: memoryview, offset: int) -> bool:
        """Fill `view` with the file's bytes at `offset` when they lie in one gap; False when they do not."""
        if not len(view):
            return True
        got = self._gap_view(offset, len(view))
        if got is None:
            return False
        view[:] = got
        return True

    def _gap_view(self, offset: int, n: int) -> memoryview | None:
        i = bisect.bisect_right(self._gap_starts, offset) - 1
        if i < 0:
            return None
        a, b, s = self._gap_at[i]
        if offset + n > b:
            return None
        return self._scratch_mem[s + offset - a:s + offset - a + n]


def _payload_memory() -> tuple[Callable[[int, int], Any], bool]:
    """What makes the new memory of load's large payloads, and whether that memory is filled fresh (see
    FILL_FRESH). The maker, called (nbytes, residue), returns a uint8 tensor whose storage holds exactly
    `nbytes`, starting `residue` bytes past a page. Looked up once per load (the op's lookups cost
    microseconds); a function of its own so that bench/ckpt_bench.py can hand load memory made before its
    clock starts, and so measure what making new memory costs a load."""
    op = aio_module()
    if FILL_FRESH and op.fresh_memory_status() == "ok":
        return op.empty_fresh, True
    return op.empty_at_residue, False


def _batches(sizes: list[int]) -> list[int]:
    """The batch of each of load's reads (of `sizes` bytes, in file order): a batch ends once it holds
    BATCH_BYTES, or half of what was left to read when it began, whichever is less, but TAIL_BATCH_BYTES
    at least."""
    def limit(left: int) -> int:
        return min(BATCH_BYTES, max(TAIL_BATCH_BYTES, left // 2))

    left = sum(sizes)
    out = []
    batch, filled, full = 0, 0, limit(left)
    for n in sizes:
        if filled >= full:
            batch, filled, full = batch + 1, 0, limit(left)
        out.append(batch)
        filled += n
        left -= n
    return out
