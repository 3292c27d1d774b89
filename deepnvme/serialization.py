"""deepnvme.save / deepnvme.load: torch's checkpoint format at the speed of the aio_handle.

The file is torch.save's own zip archive, so stock torch.load reads what save writes and load reads what
torch.save wrote. Both are built on torch.save/torch.load themselves:

- save hands torch.save a file object (torch's writer takes any object with write()) while
  `torch.utils.serialization.config.save.storage_alignment` is 4096 in the saving thread (torch keeps
  the setting per thread), so every storage payload starts on a page. The payloads, which torch passes
  as views of the storages' own memory, go to the handle O_DIRECT and asynchronously, straight from that
  memory; the small records between them are staged in two 4 MiB page-aligned buffers. Nothing else is
  copied: the archive never exists in memory. torch's own CRC-32 (one core, slower than the disk) is
  off; the stream computes each record's CRC with zlib-ng right after queueing its write, so the CRC
  overlaps that write, and puts it where torch's zip writer leaves it zero (the data descriptor after
  the record, the central directory). The object is first pickled once into a null sink to learn which
  storages it holds, because only memory that outlives the call may be written asynchronously (torch
  makes transient host copies of device storages; those are staged, not referenced).
  The save is atomic: a temporary file in the same directory, fsync, rename over the path, fsync of the
  directory. A crash leaves the previous file intact (and at worst a temporary
  `.<name>.<host>.<pid>.<random>.deepnvme-tmp`, which the next successful save of that path removes once
  its process is gone).
- load reads the whole archive before torch.load unpickles it, in deep batches of asynchronous reads on
  two handles: every large storage payload straight into memory of its own, allocated at the payload's
  offset from a page so that the handle reads it O_DIRECT with no copy, and the rest of the file into
  one scratch buffer; a worker thread checks every record's CRC-32 (which torch.load does not, so a
  damaged file raises CheckpointFormatError naming it rather than loading garbage) while the next batch
  is read. torch.load then reads through a file object of ours: when it asks for a payload read ahead
  this way, it gets nothing, and the map_location hook hands it the storage read ahead in place of the
  one it allocated; everything else is copied out of the scratch buffer. Storage sizes, views,
  map_location and weights_only are therefore torch.load's own. Where torch would not read the payloads
  (map_location="meta") or byte-swaps them first (a big-endian file), torch's own storages are filled.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import errno
import io
import os
import pickle
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from deepnvme._core import zipformat
from deepnvme._core.aio_types import AioHandle
from deepnvme._core.crc import crc32
from deepnvme._core.direct import DIRECT_MIN_BYTES, AlignedWriter, close_pair, open_for_write
from deepnvme._core.errors import CheckpointFormatError, RefusedPickle, with_path
from deepnvme._core.files import (
    TEMP_SUFFIX,
    SeekableReader,
    close_all,
    commit,
    discard,
    open_into,
    open_regular,
    temporary_name,
)
from deepnvme._core.handles import checkpoint_handle
from deepnvme._core.memory import PAGE, Populator, address_of, aligned_buffer, byte_view, memory_of, round_up
from deepnvme._core.op import aio_module
from deepnvme._core.zipformat import Record

# Page alignment of storage payloads in the archives save writes (torch's default is 64).
STORAGE_ALIGNMENT = 4096
# Each of the two staging buffers for the small records between payloads.
STAGING_BYTES = 4 << 20
# A payload read is split into chunks of this size so that checking one overlaps reading the next.
READ_CHUNK_BYTES = 4 << 20
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
# Re-exported: the names users and tests have imported from here.
__all__ = ["TEMP_SUFFIX", "CheckpointFormatError", "load", "save"]


class _Mispredicted(Exception):
    """A member's data did not start where read_records inferred: the archive must be read exactly."""


# ---------------------------------------------------------------------------------------------------- save


def save(obj: Any, path: str | os.PathLike, pickle_module: Any = pickle, pickle_protocol: int = 2, *,
         handle: AioHandle | None = None, checksum: bool = True, payloads: Any = None) -> None:
    """torch.save(obj) to `path` atomically, storage payloads written O_DIRECT from the tensors' memory.

    `handle` is an aio_handle (default: this thread's own for checkpoints in that directory, see
    deepnvme._core.handles.checkpoint_settings: a tuned file there or the process's, else 8 MiB blocks).
    Raises FileNotFoundError when the directory is missing, IsADirectoryError when `path` is a directory,
    OSError (errno, path) when a write fails — ENOSPC included — and pickling errors as torch.save does; in
    every case a file that was at `path` before is left as it was. `checksum=False` leaves every record's
    CRC-32 zero, as torch does with compute_crc32 off: stock torch.load still reads the file, but neither zip
    tools nor deepnvme.load can then check it. A symbolic link at `path` is written through, as torch.save
    does: its target is atomically replaced and the link stays.

    `payloads` lets a caller supply storage bytes that are not in memory (deepnvme.offload streams an
    optimizer's state from its swap file this way): called with each storage of `obj` as torch writes
    it, it returns a uint8 tensor holding that storage's bytes, or None to write the storage's own. The
    tensor is written before the next call, so it may be reused then.
    """
    import torch

    path = _checked_path(path)
    # A symbolic link is written through, as torch.save does: its target is replaced and the link kept.
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, f"no such directory {directory!r}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    storages = _storages_of(obj, pickle_module, pickle_protocol)  # pickling errors surface before any file
    _join_closers()
    handle = checkpoint_handle(directory) if handle is None else handle
    tmp = temporary_name(target)
    # Allocated before the temporary exists, so a failure here (ENOMEM from the mmap) leaves nothing behind.
    buffers = [aligned_buffer(STAGING_BYTES, path) for _ in range(2)]
    direct_fd = buffered_fd = -1
    replaced: list[int] = []  # the file this replaces, held open (see _hold_replaced)
    try:
        writer = None
        try:
            direct_fd, buffered_fd = open_for_write(tmp, os.O_CREAT | os.O_EXCL, 0o666)
            writer = AlignedWriter(handle, direct_fd, buffered_fd, buffers)
            # torch's own CRC-32 (one core, slower than the disk) is off; the stream computes them faster.
            with _page_aligned_storages(crc=False) as settable:
                stream = _SaveStream(writer, storages, checksums=checksum and settable, payloads=payloads)
                noted: list[BaseException] = []
                try:
                    with _interrupts_noted() as noted:
                        torch.save(obj, stream, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
                except BaseException as exc:
                    first = stream.error or (noted[0] if noted else None) or _interruption(exc)
                    if first is None or first is exc:
                        raise
                    raise first from None  # torch's RuntimeError only follows from it
            stream.close_archive()
            writer.finish()
            os.ftruncate(buffered_fd, stream.pos)
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(buffered_fd, stat.S_IMODE(os.stat(target).st_mode))  # keep a replaced file's mode
            os.fsync(buffered_fd)
        except BaseException:
            if writer is not None:  # queued writes read the staging buffers: they must end before those go
                writer.abandon()
            raise
        finally:
            close_pair(direct_fd, buffered_fd)
        _hold_replaced(target, replaced)
        commit(tmp, target)
    except OSError as exc:
        discard(tmp)  # never raises: the error to report is this one, under the caller's name for the file
        raise with_path(exc, path) from exc
    except BaseException:
        discard(tmp)
        raise
    finally:
        _close_later(replaced)


class _SaveStream:
    """The file object torch.save writes into: positions its bytes, hands payloads over with their memory.

    With `checksums`, torch computes no CRC-32 (its one-core CRC is slower than the disk) and the stream
    fills them in: each record's CRC is computed here with crc32 (zlib-ng), right after its payload was
    queued to the handle, so it overlaps that payload's own write; the CRC goes into the record's data
    descriptor (which torch's zip writer puts right after the data) and into the central directory
    (held back until torch has written all of it).
    """

    def __init__(self, writer: AlignedWriter, storages: dict[tuple[int, int], Any],
                 checksums: bool = False, payloads: Any = None) -> None:
        self._writer = writer
        self._storages = storages
        self._payloads = payloads
        self._zip = zipformat.CrcFollower() if checksums else None
        self.pos = 0
        # The first error a write raised (OSError EMFILE from the handle, KeyboardInterrupt...). torch's zip
        # writer finishes the archive even after one, and the write that follows fails on torch's own check
        # ("unexpected pos"): that RuntimeError would hide this. save() raises this instead, and every write
        # after it is dropped (the temporary is discarded).
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.error is not None:
            return len(memoryview(data).cast("B"))
        try:
            return self._write(data)
        except BaseException as exc:
            self.error = exc
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        source = supplied = None
        if n >= DIRECT_MIN_BYTES or self._payloads is not None:
            storage = self._storages.get((address_of(view), n))
            if storage is not None and self._payloads is not None:
                supplied = self._payloads(storage)
            if supplied is not None:
                if supplied.numel() != n:
                    raise ValueError(f"payloads gave {supplied.numel()} bytes for a storage of {n}")
                source, view = supplied, memory_of(supplied)
            elif storage is not None and n >= DIRECT_MIN_BYTES:
                source = byte_view(storage)
        if self._zip is None:
            self._writer.put(view, self.pos, source)
        else:
            for piece, at, piece_source in self._zip.feed(view, self.pos, source is not None):
                self._writer.put(piece, at, source if piece_source else None)
            self._zip.settle()
        if supplied is not None:  # the caller may reuse that memory once this returns
            self._writer.wait()
        self.pos += n
        return n

    def close_archive(self) -> None:
        """Write what the checksum bookkeeping held back (the central directory, its CRCs filled in)."""
        if self._zip is not None:
            for piece, at, _ in self._zip.close():
                self._writer.put(piece, at)

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """torch.serialization.skip_data() seeks over payloads; the skipped bytes stay zero."""
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset}.get(whence)
        if target is None or target < self.pos:
            raise io.UnsupportedOperation("the save stream only seeks forward")
        if self._zip is not None:
            self._zip.lost("the stream seeked")
        self.pos = target
        return target

    def flush(self) -> None:
        """The bytes are already on their way; save() waits for them before the rename."""


def _storages_of(obj: Any, pickle_module: Any, protocol: int) -> dict[tuple[int, int], Any]:
    """The CPU storages pickling `obj` reaches, by (address, bytes): the memory that outlives torch.save."""
    import torch

    found: dict[tuple[int, int], Any] = {}

    class _Finder(pickle_module.Pickler):  # type: ignore[name-defined, misc]
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage):
                o = o._untyped_storage  # what torch.save itself writes; .untyped() would warn
            elif not isinstance(o, torch.UntypedStorage):
                return None
            if o.device.type == "cpu" and o.nbytes() > 0:
                found[(o.data_ptr(), o.nbytes())] = o
            return 0

    _Finder(_NullSink(), protocol).dump(obj)
    return found


class _NullSink:
    """Discards what the storage finder pickles."""

    def write(self, data: Any) -> int:
        return len(data)


@contextlib.contextmanager
def _page_aligned_storages(crc: bool = True) -> Iterator[bool]:
    """Page-aligned storage records, and torch's CRC-32s on or off, for the saves of this thread; yields
    whether torch takes these settings (an older torch computes its CRCs and aligns to 64 bytes).

    torch keeps these settings per thread (ContextVar-backed config), so concurrent saves and a plain
    torch.save in another thread do not see each other's choices.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: records stay 64-aligned and payloads are staged, still correct
        yield False
        return
    alignment = config.save.storage_alignment
    if alignment % STORAGE_ALIGNMENT:
        alignment = STORAGE_ALIGNMENT
    with config.patch({"save.storage_alignment": alignment, "save.compute_crc32": crc}):
        yield True


def _hold_replaced(target: str, held: list[int]) -> None:
    """Open the regular file at `target`, if there is one, into `held` (the caller closes it with
    _close_later, whatever happens: see open_into). While it is open, the rename over the file does not
    free its blocks (for a large file that takes a file system hundreds of milliseconds); _close_later
    frees them off the caller's thread."""
    try:
        fd = open_into(held, target, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        close_all(held)


_closers: set[threading.Thread] = set()


def _join_closers() -> None:
    """Wait until the files earlier saves replaced are freed (a save should not find the disk fuller)."""
    for closer in list(_closers):
        closer.join()
        _closers.discard(closer)


def _close_later(held: list[int]) -> None:
    """Close what `held` holds on a thread of its own (see _hold_replaced)."""
    if not held:
        return

    closer = threading.Thread(target=_close_quietly, args=(held,), name="deepnvme-free-replaced", daemon=True)
    closer.start()
    _closers.add(closer)  # started first: a concurrent _join_closers may join anything in the set


def _close_quietly(held: list[int]) -> None:
    with contextlib.suppress(OSError):
        close_all(held)


def _checked_path(path: Any) -> str:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fsdecode(os.fspath(path))


# ---------------------------------------------------------------------------------------------------- load


def load(path: str | os.PathLike, map_location: Any = None, weights_only: bool = True, *,
         handle: AioHandle | None = None,
         verify: bool = True, mmap: bool = False, pickle_module: Any = None, **pickle_load_args: Any) -> Any:
    """torch.load(path, map_location, weights_only=...) with each payload read by the handle into its tensor.

    Reads any torch.save file: archives from deepnvme.save or torch.save (payloads 64-byte aligned there;
    each is read into memory placed at the same offset from a page, so it still goes O_DIRECT), legacy
    non-zip files (through plain torch.load). `verify` checks the records' CRC-32. `mmap=True` is
    torch.load's memory-mapped path unchanged. A file that is truncated, damaged or not a torch checkpoint
    raises CheckpointFormatError naming it.
    """
    path = _checked_path(path)
    kwargs = dict(pickle_load_args, map_location=map_location, weights_only=weights_only)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    fd = open_regular(path)  # a FIFO or device is refused here, without blocking
    try:
        restore = None if mmap else _restore_location(map_location)
        records = zipformat.read_records(fd, path, exact=restore is None)
        if mmap:  # torch's memory-mapped path: torch maps the file by its name
            return _torch_load(path, path, kwargs | {"mmap": mmap})
        if records is None:  # the legacy format: torch reads it, from the file opened here
            with os.fdopen(fd, "rb", closefd=False) as f:  # no dup: see zipformat.read_records
                return _torch_load(f, path, kwargs)
        if handle is None:
            where = os.path.dirname(os.path.abspath(path))
            handles = [checkpoint_handle(where), checkpoint_handle(where, 1)]
        else:
            handles = [handle]
        reader = _ArchiveReader(fd, path, records, handles[0], verify)
        try:
            if restore is not None:
                try:
                    reader.prefetch(handles)
                except _Mispredicted:  # an archive not laid out as torch's writer does: read its headers
                    reader.close()
                    reader = _ArchiveReader(fd, path, zipformat.read_records(fd, path), handles[0], verify)
                    reader.prefetch(handles)
                kwargs["map_location"] = reader.substituting(restore)
            result = _torch_load(reader, path, kwargs)
            if reader.error is not None:
                raise reader.error
            return result
        finally:
            reader.close()
    finally:
        os.close(fd)


def _restore_location(map_location: Any) -> Any:
    """torch.load's own function placing each loaded storage where `map_location` says, or None where
    load cannot hand torch its storages (map_location to meta reads nothing; a torch without it)."""
    import torch.serialization as ts

    get = getattr(ts, "_get_restore_location", None)
    is_meta = getattr(ts, "_is_meta_location", None)
    if get is None or is_meta is None or is_meta(map_location):
        return None
    return get(map_location)


def _torch_load(f: Any, path: str, kwargs: dict[str, Any]) -> Any:
    """torch.load, every error it raises about the file turned into CheckpointFormatError naming `path`.

    Whatever torch raises while it reads an archive whose structure read_records accepted comes from the
    file (a pickle naming records that are not there, a record of another size, a member named `..`, a
    damaged pickle): CheckpointFormatError. What is not about the file keeps its type: the caller's
    map_location failing (a CUDA device on a machine without one), MemoryError, KeyboardInterrupt. A
    weights_only refusal stays a pickle.UnpicklingError (stock's type) and is a CheckpointFormatError too.
    """
    import torch

    noted: list[BaseException] = []
    try:
        with _interrupts_noted() as noted:
            return torch.load(f, **kwargs)
    except Exception as exc:
        error = getattr(f, "error", None) or (noted[0] if noted else None) or _interruption(exc)
        if error is not None:
            raise error from exc
        if _out_of_memory(exc):
            raise MemoryError(f"{path}: out of memory while torch.load made its tensors ({exc})") from exc
        if exc is getattr(f, "restore_error", None) or isinstance(exc, MemoryError) or _about_devices(exc):
            if hasattr(exc, "add_note"):
                exc.add_note(f"while loading {path}")
            raise
        if isinstance(exc, OSError):
            raise with_path(exc, path, "reading") from exc
        if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
            raise RefusedPickle(path, str(exc)) from exc
        problem = f"damaged or not a torch checkpoint ({type(exc).__name__}: {exc})"
        raise CheckpointFormatError(path, problem) from exc


@contextlib.contextmanager
def _interrupts_noted() -> Iterator[list[BaseException]]:
    """Collect what the SIGINT handler raises meanwhile (on the main thread, where a Python handler is
    installed: Python's own, which raises KeyboardInterrupt, or the program's; else the list stays empty).

    Why: torch's C++ calls the stream's readinto and write. A Ctrl-C that lands as one of them begins,
    before any of its code runs, escapes into torch, whose reader then tries another method and replaces
    the exception with an AttributeError of its own, chaining nothing: the load would call a good file
    damaged. The installed handler is wrapped for the duration, so what it raises is noted before it is
    raised and the caller can raise that instead.
    """
    noted: list[BaseException] = []
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield noted
        return

    def note(signum: int, frame: Any) -> Any:
        try:
            return handler(signum, frame)
        except BaseException as exc:
            noted.append(exc)
            raise

    try:
        signal.signal(signal.SIGINT, note)  # inside the try: an interrupt right after it still restores
        yield noted
    finally:
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, handler)


def _interruption(exc: BaseException) -> BaseException | None:
    """A KeyboardInterrupt or SystemExit among what led to `exc`, if any. One raised inside a callback of
    torch's C++ (a stream's write or readinto) comes back wrapped in an error of torch's own (a RuntimeError,
    or an AttributeError when its reader falls back to another method), which would read as a damaged file
    or a failed write: the interruption is what happened."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, (KeyboardInterrupt, SystemExit)):
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None


def _out_of_memory(exc: Exception) -> bool:
    """torch's CPU allocator failing: it raises a plain RuntimeError, which must not read as a damaged
    file (the file is intact). A device's OutOfMemoryError keeps its type (see _about_devices)."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _about_devices(exc: Exception) -> bool:
    """torch's errors for a map_location this machine cannot serve (no CUDA, no such device, out of its
    memory)."""
    import torch

    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True  # out of the device's memory: not the file's fault either
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("is_available() is False" in text
                                              or "Attempting to deserialize object on" in text)


# Where the kernel exposes this process's descriptors: reopening one there gives the file it holds, even
# after its path was renamed over or unlinked.
_PROC_FD = "/proc/self/fd/{}"


class _ArchiveReader(SeekableReader):
    """A seekable reader torch.load reads the archive through.

    Without prefetch() every member torch asks for is read on demand (_read_member). After prefetch()
    the whole file already sits in memory, read by the handle in a few deep batches: each large storage
    payload in a storage of its own (see _Prefetched for how), and everything else (headers, the pickle,
    small payloads, the directory) in one scratch buffer that reads are served from. torch then still
    allocates each payload's memory and asks for it; that read is skipped and the map_location hook from
    substituting() hands torch the prefetched storage instead, so the bytes are never copied.
    """

    def __init__(self, fd: int, path: str, records: dict[int, Record], handle: AioHandle,
                 verify: bool) -> None:
        super().__init__(os.fstat(fd).st_size)
        if records and max(r.end for r in records.values()) > self._size:
            raise CheckpointFormatError(path, "truncated: the file shrank while it was being read")
        self._fd = fd
        self._path = path
        self._records = records
        self._handle = handle
        self._verify = verify
        self._direct_fd = -1
        self._opened: list[int] = []  # descriptors this reader opened (_direct), closed by close()
        self._prefetched: _Prefetched | None = None
        self._skipped: dict[int, Record] = {}  # torch's payload memory left unread, by address
        self._substitute = False
        self.error: Exception | None = None  # the first failure; torch only sees a short read
        self.restore_error: Exception | None = None  # an error of the caller's map_location

    def prefetch(self, handles: list[AioHandle]) -> None:
        """Read the whole archive now (see the class); raises OSError or CheckpointFormatError."""
        self._prefetched = _Prefetched(self._direct(), self._path, self._size, self._records, handles,
                                       self._verify)
        order = self._prefetched.member_bytes("byteorder")
        # A payload torch must byte-swap is swapped in torch's memory before the hook sees it: copy there.
        self._substitute = order is not None and bytes(order).decode("ascii", "replace") == sys.byteorder

    def substituting(self, restore: Any) -> Any:
        """A map_location for torch.load: torch's storage for a prefetched payload becomes the prefetched
        storage (same bytes, no copy), then `restore` (torch's own for the caller's map_location) runs."""

        def restore_prefetched(storage: Any, location: str) -> Any:
            record = self._skipped.pop(storage.data_ptr(), None) if storage.device.type == "cpu" else None
            if record is not None:
                ours = self._prefetched.storage_of(record)
                if storage.nbytes() != ours.nbytes():  # torch sized it by the record: cannot differ
                    raise CheckpointFormatError(self._path, f"damaged: {record.name} holds {ours.nbytes()} "
                                                f"bytes, the pickle asks for {storage.nbytes()}")
                storage = ours
            try:
                return restore(storage, location)
            except Exception as exc:
                self.restore_error = exc  # the caller's map_location failed, not the file
                raise

        return restore_prefetched

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self.error is not None:
            return 0
        record = self._records.get(self._pos)
        try:
            if self._prefetched is not None:
                n = self._from_prefetched(view, record)
            elif record is not None and record.size == len(view):
                self._read_member(view, record)
                n = len(view)
            else:
                n = _pread_into(self._fd, view, self._pos)
        except (OSError, ValueError) as exc:  # the handle's ValueError: a read past a shrunk file's end
            self.error = _read_failure(exc, self._fd, self._path, self._size)
            if self.error is not exc:
                self.error.__cause__ = exc
            return 0
        except BaseException as exc:  # Ctrl-C: torch would turn it into an error of its own (_interruption)
            self.error = exc
            return 0
        self._pos += n
        return n

    def _from_prefetched(self, view: memoryview, record: Record | None) -> int:
        prefetched = self._prefetched
        if record is not None and record.size == len(view) and prefetched.has_storage(record):
            if self._substitute:
                self._skipped[address_of(view)] = record
            else:
                view[:] = memory_of(prefetched.tensor_of(record))
            return len(view)
        if prefetched.copy_out(view, self._pos):
            return len(view)
        return _pread_into(self._fd, view, self._pos)

    def close(self) -> None:
        self._direct_fd = -1
        close_all(self._opened)
        self._prefetched = None
        self._skipped.clear()
        super().close()

    def _read_member(self, view: memoryview, record: Record) -> None:
        """Fill `view` (torch's storage memory) with the member's bytes and check them."""
        start, end = record.offset, record.offset + record.size
        check = self._verify and record.crc is not None
        if record.size < DIRECT_MIN_BYTES:
            _pread_exactly(self._fd, view, start, self._path)
            crc = crc32(view) if check else 0
        else:
            # Partial first and last pages buffered; the whole pages between through the handle.
            head = min(end, -(-start // PAGE) * PAGE) - start
            tail = max(head, record.size - end % PAGE)
            _pread_exactly(self._fd, view[:head], start, self._path)
            _pread_exactly(self._fd, view[tail:], start + tail, self._path)
            crc = crc32(view[:head]) if check else 0
            crc = self._read_pages(view, start, head, tail, crc, check)
            crc = crc32(view[tail:], crc) if check else 0
        if check and crc != record.crc:
            raise _crc_error(self._path, record, crc)

    def _read_pages(self, view: memoryview, start: int, first: int, last: int, crc: int, check: bool) -> int:
        """Read view[first:last] (whole pages of the file) through the handle; checksum chunk i during i+1."""
        import torch

        if last <= first:
            return crc
        dest = torch.frombuffer(view, dtype=torch.uint8)
        fd = self._direct()
        chunk = READ_CHUNK_BYTES if check else last - first
        previous = None
        for a in range(first, last, chunk):
            b = min(a + chunk, last)
            self._handle.async_pread(dest[a:b], fd, start + a)
            try:
                if previous is not None:
                    crc = crc32(view[previous[0]:previous[1]], crc)
            finally:
                self._handle.wait()
            previous = (a, b)
        if check and previous is not None:
            crc = crc32(view[previous[0]:previous[1]], crc)
        return crc

    def _direct(self) -> int:
        """An O_DIRECT descriptor of the very file `self._fd` holds open, or `self._fd` itself.

        The path may name another file by now (a trainer atomically replacing `latest` while this loads),
        so the file is reopened through /proc/self/fd, and a reopen by path (no /proc) is used only when
        it is the same inode. Where neither gives one (O_DIRECT refused, the file replaced and /proc
        missing), the handle reads through `self._fd`, buffered: slower, never another file's bytes.
        """
        if self._direct_fd == -1:
            self._direct_fd = self._fd
            held = os.fstat(self._fd)
            flags = os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT
            # Opened straight into self._opened, which close() empties: no moment where an interrupt could
            # leave the descriptor unowned (see open_into).
            try:
                try:
                    fd = open_into(self._opened, _PROC_FD.format(self._fd), flags)
                except FileNotFoundError:
                    if not _same_file(held, os.stat(self._path)):  # not even opened: it could be a FIFO
                        return self._direct_fd
                    fd = open_into(self._opened, self._path, flags)
            except OSError:
                return self._direct_fd
            if _same_file(held, os.fstat(fd)):
                self._direct_fd = fd
            # else another file's descriptor, never used, closed with the reader
        return self._direct_fd


def _read_failure(exc: OSError | ValueError, fd: int, path: str, size: int) -> Exception:
    """What a failed read of the `size`-byte archive at `path` (open as `fd`) is reported as.

    A file that got shorter after load measured it is a truncated checkpoint, whatever the failed read
    said: the handle reports a read that meets the new end as EIO ("short transfer"), which would read as
    a failing disk, and refuses one that starts past it with a ValueError. Otherwise an OSError names the
    path (the handle names a descriptor) and a ValueError is the file's fault.
    """
    try:
        now = os.fstat(fd).st_size
    except OSError:
        now = size
    if now < size:
        return CheckpointFormatError(path, f"truncated while being read: the file got shorter, {now} bytes "
                                     f"now, {size} when the load began")
    if isinstance(exc, CheckpointFormatError):
        return exc
    if isinstance(exc, OSError):
        return exc if exc.filename == path else with_path(exc, path, "reading")
    return CheckpointFormatError(path, f"truncated while being read ({exc})")


def _crc_error(path: str, record: Record, crc: int) -> CheckpointFormatError:
    return CheckpointFormatError(path, f"damaged: the CRC-32 of {record.name} does not match "
                                 f"(stored {record.crc:#010x}, read {crc:#010x})")


@dataclass
class _Piece:
    """One read of the prefetch: file bytes [offset, offset + tensor's length) into `tensor`."""

    offset: int
    tensor: Any
    batch: int = 0


class _Prefetched:
    """The whole archive read into memory by the handles (see _ArchiveReader), CRCs checked.

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
                failure = _read_failure(exc, self._fd, self._path, self._size)
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
                    raise _Mispredicted(r.name)
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
                    raise _crc_error(self._path, r, got)

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


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read what there is (up to len(view)) at `offset`."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _pread_exactly(fd: int, view: memoryview, offset: int, path: str) -> None:
    if _pread_into(fd, view, offset) != len(view):
        raise CheckpointFormatError(path, f"truncated: expected {len(view)} bytes at offset {offset}")
