"""File systems mounted for a test (root only): ramfs (no O_DIRECT), size-limited or read-only tmpfs."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(path: Path, fstype: str, options: str = "") -> Iterator[Path]:
    """`fstype` mounted at `path` (created) with `options`; skips the test where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"mount -t {fstype} failed (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
