"""Where the owned units lie in the swap file: the ranges in use, the ranges given back, and the drive's
space behind them.

A unit removed (the state of a parameter the optimizer no longer has) gives its range back: at the end of
the file the file is cut short; elsewhere the range joins a free list that later units are placed in (the
smallest free range that fits), and its blocks are released to the file system with a punched hole, so
the drive's space comes back at once and not only when the range is used again. Every range handed out is
reserved with fallocate first, so a full disk shows up when a unit is added, naming the directory, never
as a short write later.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import os

# fallocate(2) modes: release the blocks of a range, keeping the file's length.
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Release the blocks of [offset, offset + nbytes) of `fd` (reads give zeros); False where the file
    system cannot (the range then keeps its blocks until reused)."""
    return _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0


class Extents:
    """The byte ranges of one swap file (`fd` at `path`, in `directory`): `take` one, `give` it back."""

    def __init__(self, fd: int, path: str, directory: str) -> None:
        self.fd, self.path, self.directory = fd, path, directory
        self.end = 0  # the file's length: every range lies below it
        self._free: list[tuple[int, int]] = []  # (offset, nbytes), sorted, never touching each other

    @property
    def free_bytes(self) -> int:
        """Bytes below `end` in no unit (reused before the file grows)."""
        return sum(n for _, n in self._free)

    def take(self, nbytes: int) -> int:
        """The offset of a new range of `nbytes` (whole pages), its blocks reserved; OSError ENOSPC naming
        the directory when the drive cannot hold it."""
        fits = [(n, at, i) for i, (at, n) in enumerate(self._free) if n >= nbytes]
        if fits:
            n, at, i = min(fits)
            self._reserve(at, nbytes)
            if n == nbytes:
                del self._free[i]
            else:
                self._free[i] = (at + nbytes, n - nbytes)
            return at
        at = self.end
        self._reserve(at, nbytes)
        self.end = at + nbytes
        return at

    def _reserve(self, offset: int, nbytes: int) -> None:
        try:
            os.posix_fallocate(self.fd, offset, nbytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                st = os.statvfs(self.directory)
                in_use, free = self.end - self.free_bytes, st.f_bavail * st.f_frsize
                raise OSError(errno.ENOSPC, f"no space for {nbytes} more bytes of swap ({in_use} in use, "
                              f"{free} free): free space or choose another directory",
                              self.directory) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OSError(exc.errno, exc.strerror, self.path) from exc
            if offset + nbytes > self.end:  # no fallocate here: at least the length is right
                os.ftruncate(self.fd, offset + nbytes)

    def give(self, offset: int, nbytes: int) -> None:
        """Give the range back: the file is cut at its end, or the range's blocks are released."""
        i = bisect.bisect(self._free, (offset, nbytes))
        if i > 0 and sum(self._free[i - 1]) == offset:  # joins the free range before it
            i -= 1
            offset, nbytes = self._free[i][0], self._free[i][1] + nbytes
            del self._free[i]
        if i < len(self._free) and self._free[i][0] == offset + nbytes:  # and the one after it
            nbytes += self._free[i][1]
            del self._free[i]
        if offset + nbytes == self.end:
            self.end = offset
            os.ftruncate(self.fd, offset)
            return
        self._free.insert(i, (offset, nbytes))
        punch_hole(self.fd, offset, nbytes)
