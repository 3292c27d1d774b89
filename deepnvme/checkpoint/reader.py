"""AioStorageReader: DCP's FileSystemWriter format (ours or stock) read with each payload going straight into
the tensor it belongs to through the handle where the saved chunk and the target line up, and through one
temporary otherwise (resharding); every archive's small records read ahead in a few requests at its ends."""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from deepnvme._core import zipformat
from deepnvme._core.aio_types import AioHandle
from deepnvme._core.checks import check_type
from deepnvme._core.direct import open_direct
from deepnvme._core.errors import CheckpointFormatError
from deepnvme._core.files import SeekableReader, open_regular
from deepnvme.checkpoint.io_handle import COPY_AHEAD, HandleChoice, drain_quietly
from deepnvme.checkpoint.metadata import METADATA_GLOBALS, check_storage_data, read_metadata

# Bytes read up front at each end of an archive when loading: its small records and its directory fit in them.
EDGE = 4096
# Archives' ends this close together are read as one request (a small item lies wholly inside the gap, or
# one archive's directory is followed at once by the next one's records); one such read is at most
# EDGE_READ_MAX bytes. Each request costs the disk a round trip, which dwarfs a few KiB more read.
EDGE_GAP = 16 << 10
EDGE_READ_MAX = 1 << 20


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


class AioStorageReader(HandleChoice, FileSystemReader):
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
        self._choose_handle(handle, block_size, queue_depth, intra_op_parallelism, engine)

    # The globals a `.metadata` pickle may name: DCP's metadata classes and what they hold (see
    # deepnvme.checkpoint.metadata). A subclass may add to this for metadata written with extra classes.
    METADATA_GLOBALS: frozenset[tuple[str, str]] = METADATA_GLOBALS

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled allowing only DCP's metadata classes (stock DCP unpickles
        it in full, so a crafted `.metadata` runs code); errors say which checkpoint and file are at fault."""
        path = str(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_metadata(path, str(self.path), self.METADATA_GLOBALS)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """As FileSystemReader's, with every storage location checked first: on ranks that did not read the
        metadata themselves (the coordinator broadcasts it) too."""
        check_storage_data(metadata.storage_data, str(self._get_metadata_path(kwargs.get("rank"))))
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
            drain_quietly(handle)  # queued reads fill memory that goes with this frame: let them end first
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
