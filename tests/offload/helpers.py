"""Helpers of the offload tests: small mounts of a chosen kind, open descriptors."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mounts import mounted


def tmpfs(path: Path, options: str) -> contextlib.AbstractContextManager[Path]:
    """A tmpfs mounted at `path` with `options` (e.g. "size=1m" or "ro"); skips where mounting is refused."""
    return mounted(path, "tmpfs", options)


def open_fds() -> set[str]:
    """This process's open descriptors, by target."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out
