"""Files as the library's checkpoint writers and readers open, read and replace them: the library's one door
to op_builder.atomic_file.

Replacing a file follows the project's one recipe, op_builder.atomic_file (temporary, fsync, rename,
directory fsync, stale cleanup), re-exported here so that library modules reach op_builder only through
``_core``: deepnvme.save and the DCP writer use its steps (temporary_name, commit, discard,
fsync_directory) directly; atomic_target and write_atomically add the library's error rule on top: an
error names the caller's path, never the temporary, and a failing cleanup never hides the error that made
it necessary. Used by the DCP writer's `.metadata` and the MoE checkpoint's `latest`.

And one way to open a file for reading that never blocks on a FIFO or a device and refuses anything but a
regular file, checked on the descriptor itself (fstat after open: no window for a swap); open_into / close_all
(the recipe's too), which keep a descriptor from being lost to a KeyboardInterrupt; SeekableReader, the
seekable read-only stream torch's zip reader is handed; the one rule for "does the process that left this
behind still run?" (op_builder.liveness, re-exported: owner_alive / owner_mark / start_time, pid and start
time, for the temporaries above; hold_lock / lock_held, a flock held by the owner, for the swap space's
directories, which may be shared across PID namespaces); and the mount of a path (public as
deepnvme.filesystem.mount_of), which names a file system in the O_DIRECT notice and the tools' reports.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from deepnvme._core.errors import with_path
from op_builder.atomic_file import (
    TEMP_SUFFIX,
    close_all,
    commit,
    discard,
    fsync_directory,
    open_into,
    replace_bytes,
    temporary_name,
)
from op_builder.liveness import hold_lock, lock_held, owner_alive, owner_mark, start_time

__all__ = ["TEMP_SUFFIX", "SeekableReader", "atomic_target", "close_all", "commit", "discard",
           "fsync_directory", "hold_lock", "lock_held", "mount_of", "open_into", "open_regular",
           "owner_alive", "owner_mark", "start_time", "temporary_name", "write_atomically"]


@contextlib.contextmanager
def atomic_target(path: str, *, durable: bool = True) -> Iterator[str]:
    """Yield a temporary path to write `path`'s new content to, then commit it (see commit()).

    The body writes and, when `durable`, fsyncs the temporary. If it raises, the temporary is removed
    and an OSError is raised again naming `path` (same errno); `path` itself is untouched.
    """
    tmp = temporary_name(path)
    try:
        yield tmp
        commit(tmp, path, durable=durable)
    except OSError as exc:
        discard(tmp)
        if exc.filename in (tmp, None) or exc.filename == path:
            raise with_path(exc, path) from exc
        raise  # an error about another file (the directory's fsync names the directory)
    except BaseException:
        discard(tmp)
        raise


def write_atomically(path: str, data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically (see the module): for small files such as `latest`."""
    try:
        replace_bytes(path, data, durable=durable, mode=mode)
    except OSError as exc:
        if exc.filename is None or str(exc.filename).endswith(TEMP_SUFFIX) or exc.filename == path:
            raise with_path(exc, path) from exc
        raise  # an error about another file (the directory's fsync names the directory)


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at `path`.

    O_NONBLOCK keeps open() from waiting for a FIFO's writer (or a device's carrier); fstat on the opened
    descriptor then refuses whatever is not a regular file: IsADirectoryError for a directory, OSError
    EINVAL naming the path for a FIFO, socket or device. The non-blocking flag is cleared again (it means
    nothing to a regular file's reads, but the descriptor may be handed on). A KeyboardInterrupt at any
    point leaves nothing open (see open_into).
    """
    held: list[int] = []
    try:
        fd = open_into(held, path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket or device?), not read", path)
        os.set_blocking(fd, True)
    except BaseException:
        close_all(held)
        raise
    # Returning to a Python caller runs no handler before its `fd = open_regular(...)` stores this.
    return held[0]


class SeekableReader(io.RawIOBase):
    """A read-only stream of ``size`` bytes that seeks like a file; subclasses supply ``readinto`` at
    ``self._pos``. torch's zip reader needs seek/tell to find an archive's directory at its end."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        """A read-only stream."""
        return True

    def seekable(self) -> bool:
        """torch's zip reader seeks to the archive's directory."""
        return True

    def tell(self) -> int:
        """The current position."""
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move like a file does (never before the start)."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos


def mount_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(mount point, filesystem type) holding ``path``, from /proc/self/mountinfo; ('', '') if unknown."""
    best = ("", "")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    real = os.path.realpath(path)
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields = head.split()
        if len(fields) < 5 or not tail:
            continue
        # mountinfo escapes space, tab, newline and backslash as octal.
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, tail.split()[0])
    return best
