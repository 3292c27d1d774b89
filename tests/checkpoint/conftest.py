"""Fixtures of the checkpoint tests (deepnvme.save/load, the DCP backend, FastFileWriter): a handle, and a
small read-only file system where the test may mount one (root with mount rights; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def handle(aio_module: ModuleType) -> Any:
    """The handle the checkpoint tests pass in: 1 MiB blocks, queue depth 32, two threads."""
    return aio_module.aio_handle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=2)


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """(mount point, make_read_only): a 16 MiB tmpfs, writable until make_read_only() remounts it read-only;
    unmounted afterwards."""
    point = tmp_path / "mnt"
    point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(point)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")

    def make_read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)

    try:
        yield point, make_read_only
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(point)], check=False)
