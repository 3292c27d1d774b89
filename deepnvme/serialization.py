"""deepnvme.save / deepnvme.load: torch's checkpoint format at the speed of the aio_handle.

The file is torch.save's own zip archive, so stock torch.load reads what save writes and load reads what
torch.save wrote. Both are built on torch.save/torch.load themselves, through public doors only:

- save hands torch.save a file object (torch's writer takes any object with write()) while
  `torch.utils.serialization.config.save.storage_alignment` is 4096 in the saving thread (torch keeps
  the setting per thread), so every storage payload starts on a page. The payloads, which torch passes
  as views of the storages' own memory, go to the handle O_DIRECT and asynchronously, straight from that
  memory, while torch computes the next one's CRC; the small records between them are staged in two
  4 MiB page-aligned buffers. Nothing else is copied: the archive never exists in memory. The object is
  first pickled once into a null sink to learn which storages it holds, because only memory that
  outlives the call may be written asynchronously (torch makes transient host copies of device
  storages; those are staged, not referenced).
  The save is atomic: a temporary file in the same directory, fsync, rename over the path, fsync of the
  directory. A crash leaves the previous file intact (and at worst a temporary
  `.<name>.<host>.<pid>.<random>.deepnvme-tmp`, which the next successful save of that path removes once
  its process is gone).
- load hands torch.load a reader over the file. torch allocates each storage and asks the reader to fill
  it with one readinto(); the reader recognises the payload from the archive's directory and reads it
  through the handle into that very memory (O_DIRECT for the whole pages; the partial first and last
  page are read buffered). map_location, weights_only and the rest are therefore exactly torch.load's.
  The reader also checks every record's CRC-32, which torch.load does not, so a damaged file raises
  CheckpointFormatError naming it rather than loading garbage; the check of one chunk overlaps the read
  of the next.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import secrets
import socket
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from deepnvme.files import SeekableReader, fsync_directory
from deepnvme.io import (
    DIRECT_MIN_BYTES,
    PAGE,
    _AlignedWriter,
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
TEMP_SUFFIX = ".deepnvme-tmp"
# What stock torch.save's legacy (non-zip) format starts with: pickle protocol 2 and its magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


class CheckpointFormatError(ValueError):
    """The file is not a readable torch checkpoint: truncated, damaged, or of another format."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.filename = path


# ---------------------------------------------------------------------------------------------------- save


def save(obj: Any, path: str | os.PathLike, pickle_module: Any = pickle, pickle_protocol: int = 2, *,
         handle: Any = None, checksum: bool = True) -> None:
    """torch.save(obj) to `path` atomically, storage payloads written O_DIRECT from the tensors' memory.

    `handle` is an aio_handle (default: deepnvme.io.default_handle()). Raises FileNotFoundError when the
    directory is missing, IsADirectoryError when `path` is a directory, OSError (errno, path) when a write
    fails — ENOSPC included — and pickling errors as torch.save does; in every case a file that was at
    `path` before is left as it was. `checksum=False` skips torch's CRC-32 of every record (one core,
    about 2 GB/s, often the bound on a save): stock torch.load still reads the file, but neither zip tools
    nor deepnvme.load can then check it. A symbolic link at `path` is written through, as torch.save
    does: its target is atomically replaced and the link stays.
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
            stream = _SaveStream(writer, storages)
            with _page_aligned_storages(checksum):
                torch.save(obj, stream, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
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
        os.replace(tmp, target)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise _with_path(exc, path) from exc
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_directory(directory)
    _remove_stale_temps(directory, name)


class _SaveStream:
    """The file object torch.save writes into: positions its bytes, hands payloads over with their memory."""

    def __init__(self, writer: _AlignedWriter, storages: dict[tuple[int, int], Any]) -> None:
        self._writer = writer
        self._storages = storages
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        source = None
        if n >= DIRECT_MIN_BYTES:
            storage = self._storages.get((address_of(view), n))
            if storage is not None:
                source = byte_view(storage)
        self._writer.put(view, self.pos, source)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """torch.serialization.skip_data() seeks over payloads; the skipped bytes stay zero."""
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset}.get(whence)
        if target is None or target < self.pos:
            raise io.UnsupportedOperation("the save stream only seeks forward")
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
def _page_aligned_storages(crc: bool = True) -> Iterator[None]:
    """Page-aligned storage records, and torch's CRC-32s on or off, for the saves of this thread.

    torch keeps these settings per thread (ContextVar-backed config), so concurrent saves and a plain
    torch.save in another thread do not see each other's choices.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: records stay 64-aligned and payloads are staged, still correct
        yield
        return
    alignment = config.save.storage_alignment
    if alignment % STORAGE_ALIGNMENT:
        alignment = STORAGE_ALIGNMENT
    with config.patch({"save.storage_alignment": alignment, "save.compute_crc32": crc}):
        yield


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

    Reads any torch.save file: archives from deepnvme.save or torch.save (payloads 64-byte aligned there,
    which costs a staged copy in the handle), legacy non-zip files (through plain torch.load). `verify`
    checks the records' CRC-32. `mmap=True` is torch.load's memory-mapped path unchanged. A file that is
    truncated, damaged or not a torch checkpoint raises CheckpointFormatError naming it.
    """
    path = _checked_path(path)
    kwargs = dict(pickle_load_args, map_location=map_location, weights_only=weights_only)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        records = _records(fd, path)
        if records is None or mmap:  # the legacy format, or torch's mmap path: torch reads it itself
            return _torch_load(path, path, kwargs | {"mmap": mmap} if mmap else kwargs)
        handle = default_handle() if handle is None else handle
        with _ArchiveReader(fd, path, records, handle, verify) as reader:
            result = _torch_load(reader, path, kwargs)
            if reader.error is not None:
                raise reader.error
            return result
    finally:
        os.close(fd)


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


def _records(fd: int, path: str) -> dict[int, _Record] | None:
    """The archive's members by data offset; None for torch's legacy pickle format. Checks the structure."""
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
            members = zipfile.ZipFile(f).infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise CheckpointFormatError(path, f"truncated or damaged zip archive ({exc})") from exc
    if not any(m.filename.endswith(("/data.pkl", "/constants.pkl")) for m in members):
        raise CheckpointFormatError(path, "a zip archive but not a torch checkpoint (no data.pkl)")
    records = {}
    for m in members:
        header = os.pread(fd, 30, m.header_offset)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointFormatError(path, f"truncated or damaged: bad local header of {m.filename}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        offset = m.header_offset + 30 + name_len + extra_len
        if m.compress_type != zipfile.ZIP_STORED or offset + m.file_size > size:
            raise CheckpointFormatError(path, f"truncated or damaged: {m.filename} lies outside the file")
        crc = m.CRC if (m.CRC or m.file_size == 0) else None  # torch writes 0 when compute_crc32 is off
        records[offset] = _Record(m.filename, offset, m.file_size, crc)
    return records


# Where the kernel exposes this process's descriptors: reopening one there gives the file it holds, even
# after its path was renamed over or unlinked.
_PROC_FD = "/proc/self/fd/{}"


class _ArchiveReader(SeekableReader):
    """A seekable reader torch.load reads the archive through; whole members go to _read_member."""

    def __init__(self, fd: int, path: str, records: dict[int, _Record], handle: Any, verify: bool) -> None:
        super().__init__(os.fstat(fd).st_size)
        self._fd = fd
        self._path = path
        self._records = records
        self._handle = handle
        self._verify = verify
        self._direct_fd = -1
        self.error: Exception | None = None  # the first failure; torch only sees a short read

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self.error is not None:
            return 0
        record = self._records.get(self._pos)
        try:
            if record is not None and record.size == len(view):
                self._read_member(view, record)
                n = len(view)
            else:
                n = _pread_into(self._fd, view, self._pos)
        except (OSError, CheckpointFormatError) as exc:
            self.error = exc if isinstance(exc, CheckpointFormatError) else _read_error(exc, self._path)
            return 0
        self._pos += n
        return n

    def close(self) -> None:
        if self._direct_fd not in (-1, self._fd):
            os.close(self._direct_fd)
        self._direct_fd = -1
        super().close()

    def _read_member(self, view: memoryview, record: _Record) -> None:
        """Fill `view` (torch's storage memory) with the member's bytes and check them."""
        start, end = record.offset, record.offset + record.size
        check = self._verify and record.crc is not None
        if record.size < DIRECT_MIN_BYTES:
            _pread_exactly(self._fd, view, start, self._path)
            crc = zlib.crc32(view) if check else 0
        else:
            # Partial first and last pages buffered; the whole pages between through the handle.
            head = min(end, -(-start // PAGE) * PAGE) - start
            tail = max(head, record.size - end % PAGE)
            _pread_exactly(self._fd, view[:head], start, self._path)
            _pread_exactly(self._fd, view[tail:], start + tail, self._path)
            crc = zlib.crc32(view[:head]) if check else 0
            crc = self._read_pages(view, start, head, tail, crc, check)
            crc = zlib.crc32(view[tail:], crc) if check else 0
        if check and crc != record.crc:
            raise CheckpointFormatError(self._path, f"damaged: the CRC-32 of {record.name} does not match "
                                        f"(stored {record.crc:#010x}, read {crc:#010x})")

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
                    crc = zlib.crc32(view[previous[0]:previous[1]], crc)
            finally:
                self._handle.wait()
            previous = (a, b)
        if check and previous is not None:
            crc = zlib.crc32(view[previous[0]:previous[1]], crc)
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
