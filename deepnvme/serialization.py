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
import secrets
import socket
import stat
import struct
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from deepnvme.crc import crc32
from deepnvme.files import SeekableReader, fsync_directory
from deepnvme.io import (
    DIRECT_MIN_BYTES,
    PAGE,
    _AlignedWriter,
    _memory_of,
    _with_path,
    address_of,
    aligned_buffer,
    byte_view,
    close_pair,
    default_handle,
    open_for_write,
)

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
# batches read slower (each hand-over between the two handles thins the disk's queue), larger ones leave
# more CRC work after the last read; of 64 MiB to 512 MiB, this size came closest to the raw read.
BATCH_BYTES = 256 << 20
TEMP_SUFFIX = ".deepnvme-tmp"
# What stock torch.save's legacy (non-zip) format starts with: pickle protocol 2 and its magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


class _Mispredicted(Exception):
    """A member's data did not start where _records inferred: the archive must be read exactly."""


class CheckpointFormatError(ValueError):
    """The file is not a readable torch checkpoint: truncated, damaged, or of another format."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.filename = path


# ---------------------------------------------------------------------------------------------------- save


def save(obj: Any, path: str | os.PathLike, pickle_module: Any = pickle, pickle_protocol: int = 2, *,
         handle: Any = None, checksum: bool = True, payloads: Any = None) -> None:
    """torch.save(obj) to `path` atomically, storage payloads written O_DIRECT from the tensors' memory.

    `handle` is an aio_handle (default: deepnvme.io.default_handle()). Raises FileNotFoundError when the
    directory is missing, IsADirectoryError when `path` is a directory, OSError (errno, path) when a write
    fails — ENOSPC included — and pickling errors as torch.save does; in every case a file that was at
    `path` before is left as it was. `checksum=False` leaves every record's CRC-32 zero, as torch does
    with compute_crc32 off: stock torch.load still reads the file, but neither zip tools nor
    deepnvme.load can then check it. A symbolic link at `path` is written through, as torch.save does:
    its target is atomically replaced and the link stays.

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
    handle = default_handle() if handle is None else handle
    tmp = os.path.join(directory, f".{name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    # Allocated before the temporary exists, so a failure here (ENOMEM from the mmap) leaves nothing behind.
    buffers = [aligned_buffer(STAGING_BYTES) for _ in range(2)]
    direct_fd = buffered_fd = -1
    try:
        writer = None
        try:
            direct_fd, buffered_fd = open_for_write(tmp, os.O_CREAT | os.O_EXCL, 0o666)
            writer = _AlignedWriter(handle, direct_fd, buffered_fd, buffers)
            # torch's own CRC-32 (one core, slower than the disk) is off; the stream computes them faster.
            with _page_aligned_storages(crc=False) as settable:
                stream = _SaveStream(writer, storages, checksums=checksum and settable, payloads=payloads)
                torch.save(obj, stream, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
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
        replaced = _hold_replaced(target)
        try:
            os.replace(tmp, target)
        except BaseException:
            _close_quietly(replaced)
            raise
    except OSError as exc:
        _unlink_quietly(tmp)
        raise _with_path(exc, path) from exc
    except BaseException:
        _unlink_quietly(tmp)
        raise
    try:
        fsync_directory(directory)
        _remove_stale_temps(directory, name)
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

    def __init__(self, writer: _AlignedWriter, storages: dict[tuple[int, int], Any],
                 checksums: bool = False, payloads: Any = None) -> None:
        self._writer = writer
        self._storages = storages
        self._payloads = payloads
        self._zip = _ZipFollower() if checksums else None
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
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
                source, view = supplied, _memory_of(supplied)
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


# Zip signatures of torch's archives (miniz writes every member with a data descriptor, flag bit 3).
_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"


class _ZipFollower:
    """Follows torch's zip writer through its write() calls to put the CRC-32s into the archive.

    miniz writes each member as: local header (30 bytes, CRC and sizes zero, flag bit 3), file name,
    extra field (torch's padding to the storage alignment), then, if the member has data, the data in
    one write and a data descriptor (16 bytes, 24 for zip64: signature, CRC, sizes). An empty member has
    neither. The central directory comes last. So the write after a header's extra field is taken as
    data (its CRC computed at once) and confirmed by the descriptor that follows with its length; a write
    that may instead be the next header or the directory (it starts with their signature and is not a
    known storage) is held, copied, until that is settled. feed() and close() give back what to write,
    as (bytes, file offset, is the caller's storage payload). If the calls ever stop matching this
    layout, the follower warns and stops filling them in: the central directory keeps the zeros torch
    wrote, which torch.load and deepnvme.load read as "no CRC" (zip tools will call them wrong).
    """

    def __init__(self) -> None:
        self._header = bytearray()  # the local header being read
        self._need = 30  # bytes of header still to come (30, then the name and extra field)
        self._state = "header"  # header | data | descriptor | central | lost
        self._name = ""
        self._data_len = 0
        self._data_crc = 0
        self._held: tuple[bytes, int] | None = None  # a write that may be data or the next header
        self._unsettled: memoryview | None = None  # data given back whose CRC is still to compute
        self._central = bytearray()
        self._central_at = 0
        self.crcs: dict[str, int] = {}

    def lost(self, why: str) -> None:
        if self._state != "lost":
            import warnings

            warnings.warn(f"deepnvme.save: {why}, which the CRC-32 bookkeeping does not follow; this "
                          "archive's CRC fields stay zero", RuntimeWarning, stacklevel=4)
            self._state = "lost"

    def feed(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        if self._state == "lost":
            return [(view, at, known_storage)]
        if self._state == "central":
            self._central += view
            return []
        if self._state == "data":
            return self._data(view, at, known_storage)
        if self._state == "descriptor":
            return self._descriptor(view, at, known_storage)
        return self._header_bytes(view, at, known_storage)

    def close(self) -> list[tuple[Any, int, bool]]:
        out: list[tuple[Any, int, bool]] = []
        if self._held is not None:  # a last write that was held and never confirmed as data
            held, self._held = self._held, None
            self._state = "header"
            out += self._header_bytes(memoryview(held[0]), held[1], False)
        if self._state == "central":
            self._patch_central()
            out.append((memoryview(self._central), self._central_at, False))
            self._central = bytearray()
        elif self._state not in ("lost", "header"):
            self.lost("torch's archive ended inside a member")
        return out

    def _header_bytes(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        if not self._header and bytes(view[:4]) == _CENTRAL:
            self._state, self._central, self._central_at = "central", bytearray(view), at
            return []
        if not self._header and bytes(view[:4]) != _LOCAL:
            self.lost("a member did not start with a local header")
            return [(view, at, known_storage)]
        if len(view) > self._need:
            self.lost("a local header shared a write with other bytes")
            return [(view, at, known_storage)]
        self._header += view
        self._need -= len(view)
        if self._need == 0:
            if len(self._header) == 30:
                name_len, extra_len = struct.unpack_from("<HH", self._header, 26)
                self._need = name_len + extra_len
            if self._need == 0:
                name_len = struct.unpack_from("<H", self._header, 26)[0]
                self._name = bytes(self._header[30:30 + name_len]).decode("utf-8", "replace")
                self._header, self._need, self._state = bytearray(), 30, "data"
        return [(view, at, known_storage)]

    def _data(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        self._data_len = len(view)
        self._state = "descriptor"
        if not known_storage and bytes(view[:4]) in (_LOCAL, _CENTRAL):
            # The member may be empty and this the next header or the directory: hold it until known.
            self._held = (bytes(view), at)
            self._data_crc = crc32(self._held[0])
            return []
        # Written first (settle() computes its CRC after), so the CRC overlaps the payload's own write.
        self._unsettled = view
        return [(view, at, known_storage)]

    def settle(self) -> None:
        """The CRC of the data feed() just gave back, once the caller has queued its write."""
        if self._unsettled is not None:
            self._data_crc = crc32(self._unsettled)
            self._unsettled = None

    def _descriptor(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        held, self._held = self._held, None
        if _is_descriptor(view, self._data_len):
            self.crcs[self._name] = self._data_crc
            patched = bytearray(view)
            struct.pack_into("<I", patched, 4, self._data_crc)
            self._state = "header"
            out = [] if held is None else [(memoryview(held[0]), held[1], False)]
            return [*out, (memoryview(patched), at, False)]
        if held is None:
            self.lost("a member's data was not followed by its data descriptor")
            return [(view, at, known_storage)]
        # The held write was no data: the member was empty and that write came after it.
        self.crcs[self._name] = 0
        self._state = "header"
        out = self._header_bytes(memoryview(held[0]), held[1], False)
        return out + self.feed(view, at, known_storage)

    def _patch_central(self) -> None:
        """Put each member's CRC into its central directory entry (46 bytes, name, extra, comment)."""
        c, i = self._central, 0
        while c[i:i + 4] == _CENTRAL and i + 46 <= len(c):
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", c, i + 28)
            name = bytes(c[i + 46:i + 46 + name_len]).decode("utf-8", "replace")
            size = struct.unpack_from("<I", c, i + 24)[0]
            if name in self.crcs:
                struct.pack_into("<I", c, i + 16, self.crcs[name])
            elif size:
                self.lost(f"the central directory names {name!r}, which was not followed")
                return
            i += 46 + name_len + extra_len + comment_len


def _is_descriptor(view: memoryview, data_len: int) -> bool:
    """A data descriptor for `data_len` bytes of data, as torch leaves it (CRC zero)."""
    if len(view) == 16 and bytes(view[:4]) == _DESCRIPTOR:
        crc, comp, uncomp = struct.unpack_from("<III", view, 4)
    elif len(view) == 24 and bytes(view[:4]) == _DESCRIPTOR:
        crc, comp, uncomp = struct.unpack_from("<IQQ", view, 4)
    else:
        return False
    return crc == 0 and comp == uncomp == data_len


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


_HOST = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname()) or "host"


def _remove_stale_temps(directory: str, name: str) -> None:
    """Delete temporaries of `name` left by this host's processes that no longer exist (killed saves)."""
    prefix = f".{name}.{_HOST}."
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not (entry.name.startswith(prefix) and entry.name.endswith(TEMP_SUFFIX)):
                continue
            pid_text = entry.name[len(prefix):].split(".", 1)[0]
            if pid_text.isdigit() and int(pid_text) != os.getpid() and not _process_exists(int(pid_text)):
                _unlink_quietly(entry.path)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _hold_replaced(target: str) -> int:
    """An open descriptor of the regular file at `target`, or -1. While it is open, the rename over the
    file does not free its blocks (for a large file that takes a file system hundreds of milliseconds);
    _close_later frees them off the caller's thread."""
    try:
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return -1
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        return -1
    return fd


_closers: set[threading.Thread] = set()


def _join_closers() -> None:
    """Wait until the files earlier saves replaced are freed (a save should not find the disk fuller)."""
    for closer in list(_closers):
        closer.join()
        _closers.discard(closer)


def _close_later(fd: int) -> None:
    if fd < 0:
        return

    closer = threading.Thread(target=_close_quietly, args=(fd,), name="deepnvme-free-replaced", daemon=True)
    closer.start()
    _closers.add(closer)  # started first: a concurrent _join_closers may join anything in the set


def _close_quietly(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _checked_path(path: Any) -> str:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fsdecode(os.fspath(path))


# ---------------------------------------------------------------------------------------------------- load


def load(path: str | os.PathLike, map_location: Any = None, weights_only: bool = True, *, handle: Any = None,
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
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        restore = None if mmap else _restore_location(map_location)
        records = _records(fd, path, exact=restore is None)
        if records is None or mmap:  # the legacy format, or torch's mmap path: torch reads it itself
            return _torch_load(path, path, kwargs | {"mmap": mmap} if mmap else kwargs)
        handles = [default_handle(), default_handle(1)] if handle is None else [handle]
        reader = _ArchiveReader(fd, path, records, handles[0], verify)
        try:
            if restore is not None:
                try:
                    reader.prefetch(handles)
                except _Mispredicted:  # an archive not laid out as torch's writer does: read its headers
                    reader.close()
                    reader = _ArchiveReader(fd, path, _records(fd, path), handles[0], verify)
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
    """torch.load, with its errors about the archive turned into CheckpointFormatError naming `path`."""
    import torch

    try:
        return torch.load(f, **kwargs)
    except Exception as exc:
        error = getattr(f, "error", None)
        if error is not None:
            raise error from exc
        if isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc):
            raise CheckpointFormatError(path, f"damaged archive ({exc})") from exc
        if isinstance(exc, (EOFError, pickle.UnpicklingError)) and "Weights only load failed" not in str(exc):
            raise CheckpointFormatError(path, f"damaged or not a torch checkpoint ({exc})") from exc
        if hasattr(exc, "add_note"):
            exc.add_note(f"while loading {path}")
        raise


@dataclass
class _Record:
    """One stored archive member: where its bytes lie and their CRC-32 (None when torch wrote none)."""

    name: str
    offset: int
    size: int
    crc: int | None
    header_offset: int = -1  # where its local header starts; set when `offset` is a prediction to check

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def is_storage(self) -> bool:
        """torch names storage payloads <archive>/data/<key>."""
        return self.name.partition("/")[2].startswith("data/")


def _records(fd: int, path: str, exact: bool = True) -> dict[int, _Record] | None:
    """The archive's members by data offset; None for torch's legacy pickle format. Checks the structure.

    A member's data starts after its local header, whose length only the local header tells: `exact`
    reads every one (a small read each, scattered over the file). Otherwise, for archives laid out as
    torch's zip writer lays them out (each member's data, then its data descriptor, then the next
    member), the data offset is inferred from the next member's header offset and the record keeps
    `header_offset` so that the guess is checked against the local header once that has been read.
    """
    size = os.fstat(fd).st_size
    start = os.pread(fd, len(_LEGACY_MAGIC), 0)
    if start == _LEGACY_MAGIC:
        return None
    if size == 0:
        raise CheckpointFormatError(path, "empty file, not a torch checkpoint")
    if not start.startswith(b"PK\x03\x04"):
        raise CheckpointFormatError(path, "not a torch checkpoint (not a zip archive nor the legacy format)")
    with os.fdopen(os.dup(fd), "rb") as f:
        try:
            archive = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise CheckpointFormatError(path, f"truncated or damaged zip archive ({exc})") from exc
        members = archive.infolist()
        directory = getattr(archive, "start_dir", None)
    if not any(m.filename.endswith(("/data.pkl", "/constants.pkl")) for m in members):
        raise CheckpointFormatError(path, "a zip archive but not a torch checkpoint (no data.pkl)")
    members.sort(key=lambda m: m.header_offset)
    records = {}
    for i, m in enumerate(members):
        if m.compress_type != zipfile.ZIP_STORED:
            raise CheckpointFormatError(path, f"damaged: {m.filename} is compressed, which torch never does")
        crc = m.CRC if (m.CRC or m.file_size == 0) else None  # torch writes 0 when compute_crc32 is off
        following = members[i + 1].header_offset if i + 1 < len(members) else directory
        offset = None if exact else _inferred_offset(m, following)
        if offset is None:
            offset = _local_data_offset(fd, path, m)
            record = _Record(m.filename, offset, m.file_size, crc)
        else:
            record = _Record(m.filename, offset, m.file_size, crc, m.header_offset)
        if record.end > size:
            raise CheckpointFormatError(path, f"truncated or damaged: {m.filename} lies outside the file")
        records[offset] = record
    end = 0
    for offset in sorted(records):  # load reads members into separate memory: they must not overlap
        if offset < end:
            raise CheckpointFormatError(path, f"damaged: {records[offset].name} overlaps another member")
        end = records[offset].end
    return records


def _local_data_offset(fd: int, path: str, m: zipfile.ZipInfo) -> int:
    """Where member `m`'s data starts, from its local header."""
    header = os.pread(fd, 30, m.header_offset)
    if len(header) < 30 or header[:4] != _LOCAL:
        raise CheckpointFormatError(path, f"truncated or damaged: bad local header of {m.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return m.header_offset + 30 + name_len + extra_len


def _inferred_offset(m: zipfile.ZipInfo, following: int | None) -> int | None:
    """Where torch's zip writer put member `m`'s data, given where the next thing (member or directory)
    starts; None where the layout does not say. miniz writes a data descriptor (flag bit 3) after
    non-empty data: 16 bytes, or 24 when the member needs zip64 (offset or size past 32 bits)."""
    if following is None or not m.flag_bits & 0x08:
        return None
    if m.file_size == 0:
        return following  # no data, no descriptor: the offset only has to be unique and in order
    zip64 = m.header_offset >= 0xFFFFFFFF or m.file_size >= 0xFFFFFFFF
    offset = following - (24 if zip64 else 16) - m.file_size
    return offset if offset >= m.header_offset + 30 + len(m.orig_filename.encode()) else None


# Where the kernel exposes this process's descriptors: reopening one there gives the file it holds, even
# after its path was renamed over or unlinked.
_PROC_FD = "/proc/self/fd/{}"


class _ArchiveReader(SeekableReader):
    """A seekable reader torch.load reads the archive through.

    Without prefetch() every member torch asks for is read on demand (_read_member). After prefetch()
    the whole file already sits in memory, read by the handle in a few deep batches: each large storage
    payload in a storage of its own, placed so that handle reads it O_DIRECT with no copy, and everything
    else (headers, the pickle, small payloads, the directory) in one scratch buffer that reads are served
    from. torch then still allocates each payload's memory and asks for it; that read is skipped and the
    map_location hook from substituting() hands torch the prefetched storage instead, so the bytes are
    never copied.
    """

    def __init__(self, fd: int, path: str, records: dict[int, _Record], handle: Any, verify: bool) -> None:
        super().__init__(os.fstat(fd).st_size)
        self._fd = fd
        self._path = path
        self._records = records
        self._handle = handle
        self._verify = verify
        self._direct_fd = -1
        self._prefetched: _Prefetched | None = None
        self._skipped: dict[int, _Record] = {}  # torch's payload memory left unread, by address
        self._substitute = False
        self.error: Exception | None = None  # the first failure; torch only sees a short read

    def prefetch(self, handles: list[Any]) -> None:
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
                if storage.nbytes() == ours.nbytes():
                    storage = ours
                else:  # a pickle whose size disagrees with the record's: torch's storage, filled
                    n = min(storage.nbytes(), ours.nbytes())
                    byte_view(storage)[:n].copy_(byte_view(ours)[:n])
            return restore(storage, location)

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
        except (OSError, CheckpointFormatError) as exc:
            self.error = exc if isinstance(exc, CheckpointFormatError) else _read_error(exc, self._path)
            return 0
        self._pos += n
        return n

    def _from_prefetched(self, view: memoryview, record: _Record | None) -> int:
        prefetched = self._prefetched
        if record is not None and record.size == len(view) and prefetched.has_storage(record):
            if self._substitute:
                self._skipped[address_of(view)] = record
            else:
                view[:] = _memory_of(prefetched.tensor_of(record))
            return len(view)
        if prefetched.copy_out(view, self._pos):
            return len(view)
        return _pread_into(self._fd, view, self._pos)

    def close(self) -> None:
        if self._direct_fd not in (-1, self._fd):
            os.close(self._direct_fd)
        self._direct_fd = -1
        self._prefetched = None
        self._skipped.clear()
        super().close()

    def _read_member(self, view: memoryview, record: _Record) -> None:
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
            try:
                try:
                    fd = os.open(_PROC_FD.format(self._fd), flags)
                except FileNotFoundError:
                    if not _same_file(held, os.stat(self._path)):  # not even opened: it could be a FIFO
                        return self._direct_fd
                    fd = os.open(self._path, flags)
            except OSError:
                return self._direct_fd
            if _same_file(held, os.fstat(fd)):
                self._direct_fd = fd
            else:
                os.close(fd)
        return self._direct_fd


def _crc_error(path: str, record: _Record, crc: int) -> CheckpointFormatError:
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
    read into a storage of the payload's size whose memory lies at the payload's offset from a page, so
    the handle reads it O_DIRECT straight into place; the gaps between bodies (headers, small members,
    the payloads' partial first and last pages, the directory) are read into one page-aligned scratch
    buffer. The reads go in batches of about BATCH_BYTES, alternating between the handles: while one
    batch is read, the one before it is finished (its payloads' partial pages copied in from the gaps,
    CRCs checked) on a worker thread.
    """

    def __init__(self, fd: int, path: str, size: int, records: dict[int, _Record], handles: list[Any],
                 verify: bool) -> None:
        import torch

        from deepnvme import AsyncIOBuilder

        self._path = path
        self._by_name = {r.name.partition("/")[2]: r for r in records.values()}
        ordered = sorted(records.values(), key=lambda r: r.offset)
        large = [r for r in ordered if r.is_storage and r.size >= PREFETCH_OWN_BYTES]
        empty_at_residue = AsyncIOBuilder().load().empty_at_residue
        self._tensors: dict[int, Any] = {}  # offset -> uint8 tensor over the payload's own storage
        pieces: list[_Piece] = []
        gaps: list[tuple[int, int]] = []  # file ranges read into scratch
        at = 0
        for r in large:
            body_start, body_end = _round_up(r.offset), r.end // PAGE * PAGE
            if body_start > at:
                gaps.append((at, body_start))
            tensor = empty_at_residue(r.size, r.offset % PAGE)
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
            total += _round_up(b - a)
        self._scratch = aligned_buffer(total) if total else torch.empty(0, dtype=torch.uint8)
        self._scratch_mem = _memory_of(self._scratch)
        pieces += [_Piece(a, self._scratch[s:s + b - a]) for a, b, s in self._gap_at]
        pieces.sort(key=lambda p: p.offset)
        batch, filled = 0, 0
        for p in pieces:
            if filled >= BATCH_BYTES:
                batch, filled = batch + 1, 0
            p.batch = batch
            filled += p.tensor.numel()
        # What to finish after each batch: the members whose last byte it read.
        ends = [p.offset + p.tensor.numel() for p in pieces]
        finish: list[list[_Record]] = [[] for _ in range(batch + 1)]
        for r in ordered:
            if r.size and (verify and r.crc is not None or r.offset in self._tensors or r.header_offset >= 0):
                finish[pieces[bisect.bisect_left(ends, r.end)].batch].append(r)
        self._read(fd, pieces, finish, handles, verify)

    def _read(self, fd: int, pieces: list[_Piece], finish: list[list[_Record]], handles: list[Any],
              verify: bool) -> None:
        inflight: collections.deque[tuple[Any, int]] = collections.deque()
        worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deepnvme-load-check")
        checks: list[concurrent.futures.Future[None]] = []
        try:
            i = 0
            for batch in range(len(finish)):
                handle = handles[batch % len(handles)]
                if len(inflight) == len(handles):
                    self._complete(inflight, finish, worker, checks, verify)
                    for c in checks:  # a damaged member already found: read no further
                        if c.done():
                            c.result()
                while i < len(pieces) and pieces[i].batch == batch:
                    handle.async_pread(pieces[i].tensor, fd, pieces[i].offset)
                    i += 1
                inflight.append((handle, batch))
            while inflight:
                self._complete(inflight, finish, worker, checks, verify)
            for c in checks:
                c.result()
        except BaseException:
            for handle, _ in inflight:  # the reads' memory goes with this object: let them end first
                with contextlib.suppress(OSError):
                    handle.wait()
            raise
        finally:
            worker.shutdown(wait=True, cancel_futures=True)

    def _complete(self, inflight: collections.deque[tuple[Any, int]], finish: list[list[_Record]],
                  worker: Any, checks: list[Any], verify: bool) -> None:
        """Wait for the oldest batch in flight, then hand its members to the worker."""
        handle, batch = inflight[0]
        try:
            handle.wait()
        except OSError as exc:
            inflight.popleft()
            raise _read_error(exc, self._path) from exc
        inflight.popleft()
        checks.append(worker.submit(self._finish, finish[batch], verify))

    def _finish(self, records: list[_Record], verify: bool) -> None:
        """Check inferred offsets against the local headers; copy the partial first and last pages of
        each payload in from the gaps; check the CRCs."""
        for r in records:
            if r.header_offset >= 0:
                header = self._gap_view(r.header_offset, 30)
                if header is None or bytes(header[:4]) != _LOCAL:
                    raise _Mispredicted(r.name)
                name_len, extra_len = struct.unpack_from("<HH", header, 26)
                if r.header_offset + 30 + name_len + extra_len != r.offset:
                    raise _Mispredicted(r.name)
            tensor = self._tensors.get(r.offset)
            if tensor is not None:
                mem = _memory_of(tensor)
                head, tail = _round_up(r.offset) - r.offset, r.end // PAGE * PAGE - r.offset
                if not (self.copy_out(mem[:head], r.offset) and self.copy_out(mem[tail:], r.offset + tail)):
                    raise RuntimeError(f"{self._path}: the edges of {r.name} were not read (a deepnvme bug)")
            else:
                mem = self._gap_view(r.offset, r.size)
            if verify and r.crc is not None:
                got = crc32(mem)
                if got != r.crc:
                    raise _crc_error(self._path, r, got)

    def has_storage(self, record: _Record) -> bool:
        return record.offset in self._tensors

    def tensor_of(self, record: _Record) -> Any:
        return self._tensors[record.offset]

    def storage_of(self, record: _Record) -> Any:
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


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


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


def _read_error(exc: OSError, path: str) -> OSError:
    code = exc.errno if exc.errno is not None else errno.EIO
    return OSError(code, f"{os.strerror(code)} (reading)", path)
