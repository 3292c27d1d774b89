"""Small file-system facts and acts the library and the tools share: fsync by name, the mount of a path, and
the seekable read-only stream torch's zip reader is handed.
(fsync of a directory belongs to the atomic-replace recipe, op_builder.atomic_file.)"""

from __future__ import annotations

import io
import os

from deepnvme._core.files import close_all, mount_of, open_into  # mount_of: _core's, public here

__all__ = ["SeekableReader", "fsync_path", "mount_of"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file by name, so that what was written reaches the drive, not only the page cache."""
    held: list[int] = []
    try:
        os.fsync(open_into(held, path, os.O_RDONLY))
    finally:
        close_all(held)


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
