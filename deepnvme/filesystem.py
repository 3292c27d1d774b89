"""File-system facts and acts by path, for programs and the tools: fsync a file by name, and which mount (and
file-system type) holds a path.

Named apart from ``deepnvme._core.files``, which is how the library itself opens, reads and atomically
replaces its checkpoint files; fsync of a directory belongs to that atomic-replace recipe. Formerly
``deepnvme.files`` (still importable, deprecated).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from deepnvme._core.files import close_all, open_into

__all__ = ["fsync_path", "mount_of"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file by name, so that what was written reaches the drive, not only the page cache."""
    held: list[int] = []
    try:
        os.fsync(open_into(held, path, os.O_RDONLY))
    finally:
        close_all(held)


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
