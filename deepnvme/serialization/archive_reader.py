"""The file object torch.load reads an archive through: members read on demand (whole pages through the
handle, CRC-32 checked as they come), or served from a prefetch of the whole file (prefetch), torch's own
storages then swapped for the prefetched ones by a map_location hook, so no payload is copied."""

from __future__ import annotations

import os
import sys
from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.crc import crc32
from deepnvme._core.direct import DIRECT_MIN_BYTES
from deepnvme._core.errors import CheckpointFormatError
from deepnvme._core.files import SeekableReader, close_all, open_into
from deepnvme._core.memory import PAGE, address_of, memory_of
from deepnvme._core.zipformat import Record
from deepnvme.serialization.prefetch import Prefetched
from deepnvme.serialization.read_errors import crc_error, read_failure

# A payload read is split into chunks of this size so that checking one overlaps reading the next.
READ_CHUNK_BYTES = 4 << 20


# Where the kernel exposes this process's descriptors: reopening one there gives the file it holds, even
# after its path was renamed over or unlinked.
_PROC_FD = "/proc/self/fd/{}"


class ArchiveReader(SeekableReader):
    """A seekable reader torch.load reads the archive through.

    Without prefetch() every member torch asks for is read on demand (_read_member). After prefetch()
    the whole file already sits in memory, read by the handle in a few deep batches: each large storage
    payload in a storage of its own (see Prefetched for how), and everything else (headers, the pickle,
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
        self._prefetched: Prefetched | None = None
        self._skipped: dict[int, Record] = {}  # torch's payload memory left unread, by address
        self._substitute = False
        self.error: Exception | None = None  # the first failure; torch only sees a short read
        self.restore_error: Exception | None = None  # an error of the caller's map_location

    def prefetch(self, handles: list[AioHandle]) -> None:
        """Read the whole archive now (see the class); raises OSError or CheckpointFormatError."""
        self._prefetched = Prefetched(self._direct(), self._path, self._size, self._records, handles,
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
            self.error = read_failure(exc, self._fd, self._path, self._size)
            if self.error is not exc:
                self.error.__cause__ = exc
            return 0
        except BaseException as exc:  # Ctrl-C: torch would wrap it (see interrupts)
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
            raise crc_error(self._path, record, crc)

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
