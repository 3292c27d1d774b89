"""Keep reads honest without root: probe O_DIRECT, evict a file's pages with fdatasync + fadvise, and count
the pages of a file the page cache still holds (mincore), to check that an eviction or O_DIRECT worked."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile

from deepnvme._core.direct import o_direct_refused
from deepnvme._core.memory import PAGE, round_up
from deepnvme.filesystem import fsync_path, mount_of

__all__ = ["CACHED", "DESCRIPTIONS", "FADVISE", "O_DIRECT", "cached_pages", "drop_all_caches",
           "drop_file_cache", "fsync_path", "o_direct_works", "read_mode"]

# What a read figure measured, as the tools print it.
O_DIRECT = "O_DIRECT"
FADVISE = "fadvise"
CACHED = "cached"

DESCRIPTIONS = {
    O_DIRECT: "page cache bypassed (O_DIRECT)",
    FADVISE: "page cache dropped for the file (fdatasync + POSIX_FADV_DONTNEED)",
    CACHED: "page cache could not be dropped: the figure includes cached data",
}


def o_direct_works(directory: str) -> bool:
    """True when files in `directory` can be opened with O_DIRECT (ext4/xfs yes; tmpfs, ramfs no)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    fd, path = tempfile.mkstemp(prefix=".deepnvme_odirect_", dir=directory)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        if o_direct_refused(exc):
            return False
        raise
    else:
        os.close(fd)
        return True
    finally:
        os.unlink(path)


def drop_file_cache(path: str) -> bool:
    """Flush and evict one file's cached pages; True when the kernel accepted the advice.

    Dirty pages cannot be evicted, hence the fdatasync first. tmpfs and ramfs keep their pages whatever
    the advice, so callers should pair this with o_direct_works() to know what a read really measured.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read_mode(directory: str, dropped: bool = True) -> str:
    """How a read in `directory` avoids the page cache: O_DIRECT, fadvise, or not at all (cached)."""
    if _memory_backed(directory):
        return CACHED  # tmpfs may accept O_DIRECT, yet every byte still comes from memory
    if o_direct_works(directory):
        return O_DIRECT
    return FADVISE if dropped else CACHED


def _memory_backed(directory: str) -> bool:
    """True for tmpfs/ramfs, whose pages fadvise cannot evict."""
    return mount_of(directory)[1] in ("tmpfs", "ramfs")


def drop_all_caches() -> bool:
    """Write dirty data back and drop the whole page cache (/proc/sys/vm/drop_caches): needs root; True when
    the kernel took it. Clean pages only, so nothing is lost; other programs' files are read again later."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_pages(path: str | os.PathLike[str]) -> int:
    """How many pages of the file at `path` the page cache holds now (mincore over a mapping of it; mapping
    a file reads nothing in). An OSError carries the path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap failed: {os.strerror(err)}", os.fspath(path))
        try:
            vec = ctypes.create_string_buffer(round_up(size) // PAGE)
            if _libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore failed: {os.strerror(err)}", os.fspath(path))
            return sum(b & 1 for b in vec.raw)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
