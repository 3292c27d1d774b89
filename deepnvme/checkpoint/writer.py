"""AioStorageWriter: DCP's FileSystemWriter format, each tensor's payload written O_DIRECT through the handle
from the tensor's own memory at a 4 KiB-aligned offset, the small records between payloads in whole aligned
blocks; every .distcp file and the metadata committed by atomic replace."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.checks import check_int, check_type
from deepnvme._core.direct import open_direct
from deepnvme._core.errors import with_path
from deepnvme._core.files import commit, discard, fsync_directory, temporary_name
from deepnvme.checkpoint.archive_layout import Archive, archive_of
from deepnvme.checkpoint.io_handle import COPY_AHEAD, HandleChoice, drain_quietly
from deepnvme.checkpoint.metadata import write_metadata

# File offsets of payloads, and the unit every write is rounded to: the page size suits every common device.
ALIGNMENT = 4096


# Tensors smaller than this ride along in the gap buffers (one copy) instead of a request of their own.
INLINE_BELOW = 64 << 10


# A gap (small items between payloads) this large has its whole blocks queued at once, not held in memory.
GAP_SPILL = 8 << 20


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of `t`'s storage (no copy): what torch.save writes as the payload."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


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
        self.laid_out: dict[tuple[Any, ...], Archive] = {}  # archives by tensor layout (see archive_of)

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
        arc = archive_of(t, self.laid_out)
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


class AioStorageWriter(HandleChoice, FileSystemWriter):
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
        self._choose_handle(handle, block_size, queue_depth, intra_op_parallelism, engine)

    def __getstate__(self) -> dict[str, Any]:
        """A handle cannot be pickled (a process async_save pickles us): the copy finds its own."""
        state = self.__dict__.copy()
        state["_handle"] = None
        return state

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
            # A planner whose resolve_data hands over memory of its own (read from a drive for the save)
            # says how much of it may wait for its writes: then every resolved tensor counts.
            held_limit = getattr(planner, "held_bytes_limit", None)
            limit = COPY_AHEAD if held_limit is None else held_limit
            for layout, group in zip(layouts, groups):
                for item in _bytes_first(group):
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        offset = layout.add_bytes(data.getbuffer())
                        length = layout.end - offset
                    else:
                        t, copied = _plain_cpu(data)
                        copies += copied or (t.nbytes if held_limit is not None else 0)
                        offset, length = layout.add_tensor(t)
                    # Bound the memory held by copies awaiting their writes.
                    if copies + sum(lay.queued for lay in layouts) > limit:
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
            drain_quietly(handle)
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
        write_metadata(final, metadata, durable=self.sync_files)


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
