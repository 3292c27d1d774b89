"""A torch.distributed.checkpoint storage backend whose tensor bytes move through an aio_handle with O_DIRECT.

`AioStorageWriter` / `AioStorageReader` are drop-in replacements for DCP's `FileSystemWriter` /
`FileSystemReader` and keep their on-disk format exactly: a pickled `.metadata` plus `__{rank}_{i}.distcp`
files in which every item is a complete `torch.save` archive at the offset and length the metadata names.
Stock DCP (and `format_utils.dcp_to_torch_save`) reads what this writer writes, and this reader reads what
stock DCP writes.

Why it is faster: the stock writer pickles each tensor with `torch.save` into a buffered Python file and the
stock reader `torch.load`s each item from a buffered file. Here each tensor's archive is laid out with
`torch.serialization.skip_data` (only its few small records are built in memory), padding between items puts
every large payload on a 4 KiB file offset, and the payload goes from the tensor's memory to the file through
the handle (O_DIRECT, overlapped with laying out the next archives; the handle stages through its pool only
when the tensor's address is not aligned). The gaps between payloads are
whole aligned blocks, so nothing is written through the page cache. Loading reads each payload straight into
the tensor it belongs to whenever the saved chunk and the target line up, and through one temporary
otherwise (resharding). Payload CRC32s are not computed, as with
`torch.serialization.set_crc32_options(False)`; torch.load does not check them.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from deepnvme._core import zipformat
from deepnvme._core.aio_types import AioHandle
from deepnvme._core.checks import check_int, check_type
from deepnvme._core.direct import open_direct
from deepnvme._core.errors import CheckpointFormatError, with_path
from deepnvme._core.files import (
    SeekableReader,
    atomic_target,
    commit,
    discard,
    fsync_directory,
    open_regular,
    temporary_name,
)
from deepnvme._core.handles import CHECKPOINT, check_settings, checkpoint_handle, new_handle

__all__ = ["AioStorageReader", "AioStorageWriter"]

# File offsets of payloads, and the unit every write is rounded to: the page size suits every common device.
ALIGNMENT = 4096
# Tensors smaller than this ride along in the gap buffers (one copy) instead of a request of their own.
INLINE_BELOW = 64 << 10
# Bytes of temporary copies (device tensors, views, resharding) allowed in flight before draining the handle.
COPY_AHEAD = 256 << 20
# A gap (small items between payloads) this large has its whole blocks queued at once, not held in memory.
GAP_SPILL = 8 << 20
# Bytes read up front at each end of an archive when loading: its small records and its directory fit in them.
EDGE = 4096
# Archives' ends this close together are read as one request (a small item lies wholly inside the gap, or
# one archive's directory is followed at once by the next one's records); one such read is at most
# EDGE_READ_MAX bytes. Each request costs the disk a round trip, which dwarfs a few KiB more read.
EDGE_GAP = 16 << 10
EDGE_READ_MAX = 1 << 20


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


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of `t`'s storage (no copy): what torch.save writes as the payload."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


class _ArchiveSink(io.RawIOBase):
    """Where torch.save writes one tensor's archive under skip_data: records kept, the payload left a hole."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[bytes] = []
        self.pos = 0
        self.hole: tuple[int, int] | None = None  # (offset in the archive, length) of the payload

    def writable(self) -> bool:
        """torch's zip writer writes."""
        return True

    def seekable(self) -> bool:
        """skip_data steps over the payload with a relative seek."""
        return True

    def tell(self) -> int:
        """Bytes of archive so far, the hole included."""
        return self.pos

    def write(self, data: Any) -> int:
        """Keep a record's bytes."""
        piece = bytes(memoryview(data).cast("B"))
        self.pieces.append(piece)
        self.pos += len(piece)
        return len(piece)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """The payload's hole: torch skips forward over it, once, from the current position."""
        if whence != io.SEEK_CUR or offset < 0 or self.hole is not None:
            raise io.UnsupportedOperation("only one forward skip over the payload is expected")
        head = b"".join(self.pieces)
        self.pieces = [head]
        self.hole = (self.pos, offset)
        self.pos += offset
        return self.pos


@dataclasses.dataclass
class _Archive:
    """One tensor's torch.save archive: bytes before the payload, the payload's length, bytes after it."""

    head: bytes
    payload: int
    tail: bytes

    @property
    def length(self) -> int:
        """The whole archive's size in bytes."""
        return len(self.head) + self.payload + len(self.tail)


def _layout_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What torch.save(t)'s archive (payload aside) depends on, for a plain dense tensor; None for anything
    else (subclasses, tensors with Python attributes or hooks, quantized or sparse ones), which is laid out
    on its own. Tensors of one model repeat a few shapes, so their archives are laid out once per shape."""
    if (type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized or t.__dict__
            or t._backward_hooks):
        return None
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(),
            t.requires_grad, t.is_conj(), t.is_neg())


def _archive_of(t: torch.Tensor, laid_out: dict[tuple[Any, ...], _Archive] | None = None) -> _Archive:
    """Lay out torch.save(t) without its payload (skip_data): the payload goes to disk from `t` itself.

    `laid_out` keeps the archives made so far by _layout_key: a tensor with the key of one of them gets
    the same bytes without pickling again."""
    if laid_out is None or (key := _layout_key(t)) is None:
        return _lay_out(t)
    arc = laid_out.get(key)
    if arc is None:
        arc = laid_out[key] = _lay_out(t)
    return arc


def _lay_out(t: torch.Tensor) -> _Archive:
    """torch.save(t) under skip_data, cut at the payload's hole."""
    sink = _ArchiveSink()
    with torch.serialization.skip_data():
        torch.save(t, sink)
    if sink.hole is None:  # an empty storage: nothing was skipped
        return _Archive(b"".join(sink.pieces), 0, b"")
    start, length = sink.hole
    head = sink.pieces[0]
    tail = b"".join(sink.pieces[1:])
    if len(head) != start or length != t.untyped_storage().nbytes():
        raise RuntimeError("torch.save laid out an unexpected archive under skip_data")
    return _Archive(head, length, tail)


def _split_into_files(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """Spread items over `files` files of similar size: largest tensors first, each to the lightest file."""
    if files == 1:
        return [items]
    buckets: list[list[WriteItem]] = [[] for _ in range(files)]
    sizes = [0] * files
    byte_items = [w for w in items if w.type == WriteItemType.BYTE_IO]
    tensor_items = [w for w in items if w.type != WriteItemType.BYTE_IO]
    for i, w in enumerate(byte_items):
        buckets[i % files].append(w)
    tensor_items.sort(key=_item_bytes, reverse=True)
    for w in tensor_items:
        i = sizes.index(min(sizes))
        buckets[i].append(w)
        sizes[i] += _item_bytes(w)
    return buckets


def _item_bytes(w: WriteItem) -> int:
    """A tensor write item's size in bytes, from the plan (before the tensor is resolved)."""
    td = w.tensor_data
    if td is None:
        return 0
    n = 1
    for s in td.size:
        n *= s
    return n * torch._utils._element_size(td.properties.dtype)


class _FileLayout:
    """Places the items of one .distcp file and queues its writes: gaps as whole aligned blocks, payloads
    straight from tensor memory at aligned offsets."""

    def __init__(self, handle: AioHandle, fd: int, relative_path: str) -> None:
        self.handle = handle
        self.fd = fd
        self.relative_path = relative_path
        self.gap = bytearray()  # bytes from gap_start up to the current end of the file
        self.gap_start = 0
        self.keep: list[torch.Tensor] = []  # tensors whose memory queued writes still read
        self.queued = 0  # bytes of gap copies queued since the last drain
        self.laid_out: dict[tuple[Any, ...], _Archive] = {}  # archives by tensor layout (see _archive_of)

    @property
    def end(self) -> int:
        """The file offset where the next byte goes."""
        return self.gap_start + len(self.gap)

    def add_bytes(self, data: bytes | memoryview) -> int:
        """Append buffered bytes; returns their file offset."""
        offset = self.end
        self.gap += data
        self._spill()
        return offset

    def add_tensor(self, t: torch.Tensor) -> tuple[int, int]:
        """Append torch.save(t); returns (offset, length) of its archive in the file."""
        arc = _archive_of(t, self.laid_out)
        if arc.payload < INLINE_BELOW:
            offset = self.add_bytes(arc.head)
            if arc.payload:
                self.gap += memoryview(_storage_bytes(t).numpy())
            self.gap += arc.tail
            self._spill()
            return offset, arc.length
        # Pad so the payload, not the archive, starts on an aligned offset: readers find each archive by the
        # metadata's offset, so bytes between archives are never read.
        pad = -(self.end + len(arc.head)) % ALIGNMENT
        self.gap += bytes(pad)
        offset = self.add_bytes(arc.head)
        payload_at = self.end
        self._queue_gap()
        data = _storage_bytes(t)
        body = arc.payload - arc.payload % ALIGNMENT
        if body:
            self.handle.async_pwrite(data[:body], self.fd, payload_at)
            self.keep.append(data)
        self.gap_start = payload_at + body
        self.gap = bytearray(memoryview(data[body:].numpy()))
        self.gap += arc.tail
        return offset, arc.length

    def _queue_gap(self) -> None:
        """Write the gap (it ends on an aligned offset here) and start a new one."""
        if self.gap:
            buf = torch.frombuffer(self.gap, dtype=torch.uint8)
            self.handle.async_pwrite(buf, self.fd, self.gap_start)
            self.keep.append(buf)
            self.queued += len(self.gap)
        self.gap_start = self.end
        self.gap = bytearray()

    def _spill(self) -> None:
        """Once the gap is large (many small items in a row), queue its whole blocks; keep only the rest."""
        if len(self.gap) < GAP_SPILL:
            return
        n = len(self.gap) - len(self.gap) % ALIGNMENT
        rest = bytearray(memoryview(self.gap)[n:])
        buf = torch.frombuffer(self.gap, dtype=torch.uint8, count=n)
        self.handle.async_pwrite(buf, self.fd, self.gap_start)
        self.keep.append(buf)
        self.queued += n
        self.gap_start += n
        self.gap = rest

    def close_layout(self) -> None:
        """Queue the last gap, zero-padded to whole blocks so it too goes O_DIRECT."""
        self.gap += bytes(-len(self.gap) % ALIGNMENT)
        self._queue_gap()


class AioStorageWriter(FileSystemWriter):
    """DCP StorageWriter writing FileSystemWriter's format through an aio_handle (O_DIRECT).

    Constructed like FileSystemWriter: the checkpoint directory first, then its options, plus either a
    `handle` (an aio_handle you made) or settings (aio_handle keywords) for one of its own. `thread_count`
    is the number of files per rank, as for FileSystemWriter; the handle's `intra_op_parallelism` threads
    do the I/O. Without a handle or settings, each writing thread uses a default handle of its own.

    Atomicity, beyond FileSystemWriter: each .distcp file is written under a temporary name, fsynced and then
    renamed, so a crash never leaves a half-written file under a checkpoint's name; `.metadata` is written
    last (temporary name, fsync, atomic replace) and the directory is fsynced, so a checkpoint is either
    complete with its metadata or has none of the new metadata. As with FileSystemWriter, saving again into
    a directory that holds a checkpoint replaces its data files before its metadata: save each checkpoint to
    a new directory if the previous one must survive a crash.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        *,
        handle: AioHandle | None = None,
        block_size: int | None = None,
        queue_depth: int | None = None,
        intra_op_parallelism: int | None = None,
        engine: str | None = None,
    ) -> None:
        """Point the writer at directory `path`; the options mean what they mean for FileSystemWriter."""
        check_type("path", path, (str, os.PathLike))
        check_int("thread_count", thread_count)
        super().__init__(path, single_file_per_rank=single_file_per_rank, sync_files=sync_files,
                         thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
                         cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite)
        self._handle_settings = _handle_settings(handle, {
            "block_size": block_size, "queue_depth": queue_depth,
            "intra_op_parallelism": intra_op_parallelism, "engine": engine})
        self._handle = handle

    def __getstate__(self) -> dict[str, Any]:
        """A handle cannot be pickled (a process async_save pickles us): the copy finds its own."""
        state = self.__dict__.copy()
        state["_handle"] = None
        return state

    @property
    def handle(self) -> AioHandle:
        """The handle given; else one made once from the settings given; else the calling thread's
        checkpoint handle for this directory (async_save writes from a thread of its own)."""
        if self._handle is None and self._handle_settings:
            self._handle = _resolve_handle(None, self._handle_settings, str(self.path))
        return _resolve_handle(self._handle, {}, str(self.path))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into its .distcp files; the future is already complete when returned."""
        prefix: _StoragePrefix = plan.storage_data
        directory = str(self.path)
        if self.single_file_per_rank:
            groups = [g for g in _split_into_files(list(plan.items), self.thread_count) if g]
        else:
            groups = [[w] for w in plan.items]
        files: list[tuple[str, str, str]] = []  # (relative name, temporary path, final path)
        layouts: list[_FileLayout] = []
        results: list[WriteResult] = []
        handle = self.handle
        try:
            for i in range(len(groups)):
                name = f"{prefix.prefix}{i}{DEFAULT_SUFFIX}"
                final = os.path.join(directory, name)
                tmp = temporary_name(final)
                files.append((name, tmp, final))
                # Created plainly, then opened O_DIRECT: some file systems (ramfs) create the file and then
                # refuse O_DIRECT, which would leave an O_EXCL retry facing its own file.
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                fd = open_direct(tmp, os.O_WRONLY)
                layouts.append(_FileLayout(handle, fd, name))
            copies = 0
            for layout, group in zip(layouts, groups):
                for item in _bytes_first(group):
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        offset = layout.add_bytes(data.getbuffer())
                        length = layout.end - offset
                    else:
                        t, copied = _plain_cpu(data)
                        copies += copied
                        offset, length = layout.add_tensor(t)
                    # Bound the memory held by copies awaiting their writes.
                    if copies + sum(lay.queued for lay in layouts) > COPY_AHEAD:
                        _wait_for_writes(handle, directory)
                        for lay in layouts:
                            lay.keep.clear()
                            lay.queued = 0
                        copies = 0
                    info = _StorageInfo(layout.relative_path, offset, length)
                    results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
                layout.close_layout()
            _wait_for_writes(handle, directory)
            for layout in layouts:
                layout.keep.clear()
                if self.sync_files:
                    os.fsync(layout.fd)
                os.close(layout.fd)
                layout.fd = -1
            for _, tmp, final in files:
                commit(tmp, final, durable=False)  # the directory is fsynced once, below
            if self.sync_files:
                fsync_directory(directory)
        except BaseException as exc:
            _drain_quietly(handle)
            for layout in layouts:
                if layout.fd >= 0:
                    os.close(layout.fd)
            for _, tmp, _ in files:
                discard(tmp)  # never raises: the error to report is `exc`
            finals = {tmp: final for _, tmp, final in files}
            if isinstance(exc, OSError) and exc.filename in finals:  # name the file, not its temporary
                raise with_path(exc, finals[exc.filename]) from exc
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: metadata to a temporary file, fsync, atomic replace of `.metadata`, fsync of the directory.

        FileSystemWriter removes the old `.metadata` before renaming; replacing it in one step means a crash
        leaves one metadata file or the other, never none.
        """
        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None
        final = str(self._get_metadata_path(self.rank if per_rank else None))
        with atomic_target(final, durable=self.sync_files) as tmp, open(tmp, "xb") as f:
            pickle.dump(metadata, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())


def _wait_for_writes(handle: AioHandle, directory: str) -> None:
    """Wait for the queued writes; an I/O error names the checkpoint (the handle only knows descriptors)."""
    try:
        handle.wait()
    except OSError as exc:
        what = f"writing checkpoint files failed: {exc.strerror or exc}"
        raise OSError(exc.errno, what, directory) from exc


def _bytes_first(items: Sequence[WriteItem]) -> Iterator[WriteItem]:
    """Byte items, then tensors: FileSystemWriter's order within a file."""
    yield from (w for w in items if w.type == WriteItemType.BYTE_IO)
    yield from (w for w in items if w.type != WriteItemType.BYTE_IO)


def _plain_cpu(data: Any) -> tuple[torch.Tensor, int]:
    """The tensor to save: on the CPU, owning exactly its storage (as FileSystemWriter saves it); and how
    many bytes of copy that took (0 when the caller's memory is written as it is)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"a tensor write item resolved to {type(data).__name__}, not a tensor")
    t = data.detach()
    copied = 0
    if t.device.type != "cpu":
        t = t.cpu()
        copied = t.nbytes
    if t.untyped_storage().nbytes() != t.nbytes or t.storage_offset() != 0:
        t = t.clone()
        copied = t.nbytes
    return t, copied


def _drain_quietly(handle: AioHandle) -> None:
    """Let every queued request finish before buffers are freed; the first error is already being raised."""
    try:
        handle.wait()
    except Exception:  # noqa: BLE001 - the error that brought us here is the one to report
        pass


class _FileView(SeekableReader):
    """A read-only, seekable window [offset, offset+length) of a file, for torch's zip reader.

    torch reads an archive's records in many small pieces. On a cold file each piece would be a disk round
    trip of its own, queued behind the payload reads, so the window's first and last EDGE bytes (where an
    archive's small records and its directory sit, around the payload) come read in `edges`.
    """

    def __init__(self, fd: int, offset: int, length: int, edges: _Edges) -> None:
        super().__init__(length)
        self._fd, self._offset = fd, offset
        self._head = memoryview(edges.head.numpy())
        self._tail = memoryview(edges.tail.numpy())
        self._tail_at = edges.tail_at

    def readinto(self, buffer: Any) -> int:
        """Read at the current position, never past the window (a short file gives a short read)."""
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self._size - self._pos))
        pos = self._pos
        if pos + n <= len(self._head):
            data = self._head[pos:pos + n]
        elif pos >= self._tail_at:
            data = self._tail[pos - self._tail_at:pos - self._tail_at + n]
        else:
            data = os.pread(self._fd, n, self._offset + pos) if n else b""
        out[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclasses.dataclass
class _Edges:
    """The first and last bytes of one archive, read ahead of its parsing (the whole archive in `head`
    when it lies within one read)."""

    head: torch.Tensor
    tail: torch.Tensor
    tail_at: int  # offset of `tail` within the archive

    def bytes_at(self, at: int, n: int) -> torch.Tensor | None:
        """Bytes [at, at + n) of the archive when they were read with its ends, else None."""
        if at < 0 or n < 0:  # a slice would count from the end: bytes of another place
            return None
        if at + n <= self.head.numel():
            return self.head[at:at + n]
        if at >= self.tail_at and at + n <= self.tail_at + self.tail.numel():
            return self.tail[at - self.tail_at:at - self.tail_at + n]
        return None


def _queue_edges(handle: AioHandle, fd: int, archives: Sequence[tuple[int, int]]) -> list[_Edges]:
    """Queue the reads of the two ends of each archive (offset, length) of one file, in file order, ends that
    lie within EDGE_GAP of each other read together; their _Edges, in the order of `archives`."""
    tails_at = [max(min(length, EDGE), length - EDGE) for _, length in archives]  # within each archive
    ends: list[tuple[int, int, int]] = []  # (file start, file end, 2 * archive + (0 head, 1 tail))
    for i, ((offset, length), tail_at) in enumerate(zip(archives, tails_at)):
        ends += [(offset, offset + min(length, EDGE), 2 * i), (offset + tail_at, offset + length, 2 * i + 1)]
    ends.sort()
    runs: list[list[Any]] = []  # [file start, file end, the ends read together]
    for end in ends:
        if runs and end[0] - runs[-1][1] <= EDGE_GAP and end[1] - runs[-1][0] <= EDGE_READ_MAX:
            runs[-1][1] = max(runs[-1][1], end[1])
            runs[-1][2].append(end)
        else:
            runs.append([end[0], end[1], [end]])
    placed: dict[int, tuple[torch.Tensor, int, int]] = {}  # each end: its read's buffer, start and stop in it
    for start, stop, members in runs:
        buf = torch.empty(stop - start, dtype=torch.uint8)
        if buf.numel():
            handle.async_pread(buf, fd, start)
        for a, b, which in members:
            placed[which] = (buf, a - start, b - start)
    found = []
    for i, ((_, length), tail_at) in enumerate(zip(archives, tails_at)):
        (hbuf, ha, hb), (tbuf, ta, tb) = placed[2 * i], placed[2 * i + 1]
        if hbuf is tbuf:  # both ends in one read: so is all between them
            found.append(_Edges(hbuf[ha:tb], tbuf[tb:tb], length))
        else:
            found.append(_Edges(hbuf[ha:hb], tbuf[ta:tb], tail_at))
    return found


@dataclasses.dataclass
class _PendingRead:
    """A tensor read queued in the handle, and how to finish it once the bytes are in."""

    req: ReadItem
    target: torch.Tensor
    saved: torch.Tensor | None = None  # the saved layout over a temporary, when not read into the target


class AioStorageReader(FileSystemReader):
    """DCP StorageReader for FileSystemWriter's format (ours or stock) reading tensors through an aio_handle.

    Constructed like FileSystemReader, the checkpoint directory first, plus either a `handle` or the settings
    for one of its own (default: the reading thread's own default handle).
    Items written with stream extensions (FileSystemWriter's `_extensions`) are read the stock way.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        handle: AioHandle | None = None,
        block_size: int | None = None,
        queue_depth: int | None = None,
        intra_op_parallelism: int | None = None,
        engine: str | None = None,
    ) -> None:
        """Point the reader at checkpoint directory `path`."""
        check_type("path", path, (str, os.PathLike))
        super().__init__(path)
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

    # The globals a `.metadata` pickle may name: DCP's metadata classes and what they hold (see
    # _MetadataUnpickler). A subclass may add to this for metadata written with extra classes.
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled allowing only DCP's metadata classes (stock DCP unpickles
        it in full, so a crafted `.metadata` runs code); errors say which checkpoint and file are at fault."""
        path = str(self._get_metadata_path(kwargs.get("rank")))
        if not os.path.isdir(str(self.path)):
            raise FileNotFoundError(2, f"no checkpoint directory {str(self.path)!r}", str(self.path))
        if not os.path.exists(path):
            raise FileNotFoundError(2, "no DCP checkpoint here: its metadata file is missing", path)
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, self.METADATA_GLOBALS).load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError,
                    IndexError, KeyError, MemoryError, OverflowError, RecursionError) as exc:
                raise CheckpointFormatError(path, f"not a readable DCP metadata file ({type(exc).__name__}: "
                                            f"{exc})") from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointFormatError(path, f"not a readable DCP metadata file (it holds a "
                                        f"{type(metadata).__name__})")
        _check_storage_data(metadata.storage_data, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """As FileSystemReader's, with every storage location checked first: on ranks that did not read the
        metadata themselves (the coordinator broadcasts it) too."""
        _check_storage_data(metadata.storage_data, str(self._get_metadata_path(kwargs.get("rank"))))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of `plan`: bytes buffered, tensors through the handle, file by file."""
        per_file: dict[str, list[ReadItem]] = {}
        stock: list[ReadItem] = []
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if info.transform_descriptors:
                stock.append(req)
            else:
                per_file.setdefault(info.relative_path, []).append(req)
        handle = self.handle
        for relative_path, reqs in per_file.items():
            path = os.path.join(str(self.path), relative_path)
            self._read_file(handle, path, reqs, planner)
        if stock:
            super().read_data(dataclasses.replace(plan, items=stock), planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, handle: AioHandle, path: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        """Read one .distcp file's items: queue every payload, then commit the tensors after one wait."""
        meta_fd = open_regular(path)  # a FIFO or device in the checkpoint is refused without blocking
        data_fd = -1
        try:
            # The buffered descriptor reads only archives' small records: readahead would fetch payload
            # bytes that the O_DIRECT reads fetch again.
            os.posix_fadvise(meta_fd, 0, 0, os.POSIX_FADV_RANDOM)
            data_fd = open_direct(path, os.O_RDONLY)
            size = os.fstat(meta_fd).st_size
            reqs = sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset)
            archives: dict[int, tuple[int, int]] = {}  # tensor items by their index in reqs
            for i, req in enumerate(reqs):
                info: _StorageInfo = self.storage_data[req.storage_index]
                if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
                    raise CheckpointFormatError(path, f"truncated or not this checkpoint's file: item "
                                                f"{req.storage_index.fqn!r} needs bytes [{info.offset}, "
                                                f"{info.offset + info.length}) of a {size}-byte file")
                if req.type != LoadItemType.BYTE_IO:
                    archives[i] = (info.offset, info.length)
            edges = dict(zip(archives, _queue_edges(handle, data_fd, list(archives.values()))))
            # Every archive's small parts first, all in flight at once; then each payload is queued as
            # soon as its archive is parsed, so parsing the next overlaps reading this one.
            _finish(handle, [], planner, path)
            in_flight = 0
            pending: list[_PendingRead] = []
            parses: dict[Any, tuple[torch.Tensor, int | None]] = {}  # by structure key (_queue_tensor)
            for i, req in enumerate(reqs):
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    data = os.pread(meta_fd, info.length, info.offset)
                    try:  # the planner unpickles the item (torch.load): its errors are the file's
                        planner.load_bytes(req, io.BytesIO(data))
                    except (OSError, MemoryError):
                        raise
                    except Exception as exc:
                        raise CheckpointFormatError(path, f"item {req.storage_index.fqn!r} at offset "
                                                    f"{info.offset} does not load ({type(exc).__name__}: "
                                                    f"{exc})") from exc
                    continue
                job, temp = self._queue_tensor(handle, path, meta_fd, data_fd, info, req, planner,
                                               edges.pop(i), parses)
                pending.append(job)
                in_flight += temp
                if in_flight > COPY_AHEAD:
                    _finish(handle, pending, planner, path)
                    pending, in_flight = [], 0
            _finish(handle, pending, planner, path)
        except BaseException as exc:
            _drain_quietly(handle)  # queued reads fill memory that goes with this frame: let them end first
            if isinstance(exc, ValueError) and "past end of file" in str(exc):
                # The handle refuses a read past the end: the file shrank after its size was checked.
                raise CheckpointFormatError(path, f"truncated while being read ({exc})") from exc
            raise
        finally:
            os.close(meta_fd)
            if data_fd >= 0:
                os.close(data_fd)

    def _queue_tensor(self, handle: AioHandle, path: str, meta_fd: int, data_fd: int, info: _StorageInfo,
                      req: ReadItem, planner: LoadPlanner, edges: _Edges,
                      parses: dict[Any, tuple[torch.Tensor, int | None]]) -> tuple[_PendingRead, int]:
        """Queue the read of one tensor item's payload; returns the job and its temporary's bytes."""
        try:
            (_, record_at, record_size), key = _storage_record(meta_fd, path, info.offset, info.length, edges)
        except CheckpointFormatError:
            _parse_item(meta_fd, path, info, req, edges)  # torch's own complaint, naming the item, first
            raise
        # Items of one shape and dtype hold the same pickle and records: torch.load parses one of them
        # (it costs as much as reading megabytes), the others take its result; their payload offsets are
        # their own records'.
        parsed = parses.get(key) if key is not None else None
        if parsed is None:
            parsed = _parse_item(meta_fd, path, info, req, edges)
            if key is not None:
                parses[key] = parsed
            start = parsed[1]
        else:
            start = record_at
        saved = parsed[0]
        nbytes = saved.untyped_storage().nbytes()
        # The meta load sizes the storage by the pickle and never reads the record, so check the record
        # the archive's own directory assigns it: bytes past it belong to the directory or the next item.
        if start is None or start != record_at or nbytes != record_size:
            raise CheckpointFormatError(path, f"item {req.storage_index.fqn!r}: the pickle asks for {nbytes} "
                                        f"bytes at {start}, its record holds {record_size} at {record_at}")
        target = planner.resolve_tensor(req).detach()
        span = _leading_rows(saved, req.storage_offsets, req.lengths)
        if (span is not None and target.device.type == "cpu" and target.dtype == saved.dtype
                and target.is_contiguous() and list(target.shape) == list(req.lengths) and span[1] > 0):
            # The bytes wanted are one run of the payload: read them into the target itself, or copy them
            # from the archive's ends when those hold them (a small item's payload).
            inside = edges.bytes_at(start + span[0], span[1])
            if inside is not None:
                target.reshape(-1).view(torch.uint8).copy_(inside)
            else:
                handle.async_pread(target.reshape(-1).view(torch.uint8), data_fd,
                                   info.offset + start + span[0])
            return _PendingRead(req, target), 0
        inside = edges.bytes_at(start, nbytes)
        if inside is not None:
            buf = inside.clone()
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                handle.async_pread(buf, data_fd, info.offset + start)
        layout = torch.empty(0, dtype=saved.dtype).set_(buf.untyped_storage(), saved.storage_offset(),
                                                        saved.shape, saved.stride())
        return _PendingRead(req, target, layout), nbytes


def _parse_item(fd: int, path: str, info: _StorageInfo, req: ReadItem, edges: _Edges
                ) -> tuple[torch.Tensor, int | None]:
    """The item's tensor on the meta device as torch.load makes it, and where torch says its payload
    starts; CheckpointFormatError when torch cannot read it or it holds no tensor."""
    try:
        # A meta-device load reads only the archive's small records and tells where the payload lies.
        saved = torch.load(_FileView(fd, info.offset, info.length, edges), map_location="meta",
                           weights_only=True)
    except Exception as exc:
        raise CheckpointFormatError(path, f"item {req.storage_index.fqn!r} at offset {info.offset} is "
                                    f"not a readable torch.save archive (damaged file?): {exc}") from exc
    if not isinstance(saved, torch.Tensor):
        raise CheckpointFormatError(path, f"item {req.storage_index.fqn!r} holds a "
                                    f"{type(saved).__name__}, not a tensor")
    return saved, getattr(saved.untyped_storage(), "_checkpoint_offset", None)


def _storage_record(fd: int, path: str, offset: int, length: int,
                    edges: _Edges) -> tuple[tuple[str, int, int], Any]:
    """(key, offset, size) within the item of its archive's one storage record, from the archive's
    directory and local header (both in the edges read ahead, as a rule), and the archive's structure key
    (zipformat.storage_record)."""
    view = _FileView(fd, offset, length, edges)

    def read_at(at: int, n: int) -> bytes:
        view.seek(at)
        return view.read(n) or b""

    try:
        return zipformat.storage_record(view, path, read_at, key=True)  # type: ignore[return-value]
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(path, f"the item at offset {offset}: {exc}") from exc


def _check_storage_data(storage_data: Any, path: str) -> None:
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


def _leading_rows(saved: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]
                  ) -> tuple[int, int] | None:
    """(byte offset, byte count) within the payload of the chunk [offsets, offsets+lengths) of `saved`, when
    that chunk is one contiguous run: a contiguous tensor cut along its first dimension only (or not at all).
    """
    shape = list(saved.shape)
    if not saved.is_contiguous() or saved.storage_offset() != 0 or len(offsets) != len(shape):
        return None
    if any(o != 0 for o in offsets[1:]) or list(lengths[1:]) != shape[1:]:
        return None
    if shape and not 0 <= offsets[0] <= offsets[0] + lengths[0] <= shape[0]:
        return None
    row = saved.element_size()
    for s in shape[1:]:
        row *= s
    if not shape:  # a 0-dimensional tensor: the whole of it
        return 0, saved.element_size()
    return offsets[0] * row, lengths[0] * row


def _finish(handle: AioHandle, pending: list[_PendingRead], planner: LoadPlanner, path: str) -> None:
    """Wait for everything queued, then copy the resharded tensors into place and commit every tensor."""
    try:
        handle.wait()
    except OSError as exc:
        raise OSError(exc.errno, f"reading checkpoint file failed: {exc.strerror or exc}", path) from exc
    for job in pending:
        if job.saved is not None:
            part = narrow_tensor_by_index(job.saved, job.req.storage_offsets, job.req.lengths)
            if part.shape != job.target.shape:
                raise CheckpointFormatError(path, f"item {job.req.storage_index.fqn!r} holds shape "
                                            f"{tuple(part.shape)}, the load asks for "
                                            f"{tuple(job.target.shape)}")
            job.target.copy_(part)
        planner.commit_tensor(job.req, job.target)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The data files of a DCP checkpoint directory (both writers name them alike), sorted."""
    return sorted(Path(path).glob(f"__*{DEFAULT_SUFFIX}"))
