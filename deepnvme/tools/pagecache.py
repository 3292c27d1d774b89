"""Keep reads honest without root: probe O_DIRECT and evict a file's pages with fdatasync + fadvise."""

from __future__ import annotations

import os
import tempfile

from deepnvme._core.direct import o_direct_refused
from deepnvme.files import fsync_path, mount_of

__all__ = ["CACHED", "DESCRIPTIONS", "FADVISE", "O_DIRECT", "drop_file_cache", "fsync_path", "o_direct_works",
           "read_mode"]

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
