"""File-system facts and acts by path, for programs and the tools: fsync a file by name, and which mount (and
file-system type) holds a path.

Named apart from ``deepnvme._core.files``, which is how the library itself opens, reads and atomically
replaces its checkpoint files; fsync of a directory belongs to that atomic-replace recipe. Formerly
``deepnvme.files`` (still importable, deprecated).
"""

from __future__ import annotations

import os

from deepnvme._core.files import close_all, mount_of, open_into  # mount_of: _core's, public here

__all__ = ["fsync_path", "mount_of"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file by name, so that what was written reaches the drive, not only the page cache."""
    held: list[int] = []
    try:
        os.fsync(open_into(held, path, os.O_RDONLY))
    finally:
        close_all(held)
