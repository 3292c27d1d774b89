"""Mounted file systems for the tests that need one (root with mount rights; skipped elsewhere): a small
full-able ext4 on a loop device and a ramfs, which refuses O_DIRECT (fixtures, shared through
tests/conftest.py), and `mounted`, any file system type with options for the length of a block."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

MiB = 1 << 20


def sh(*cmd: str) -> subprocess.CompletedProcess:
    """Run a system command, capturing its output."""
    return subprocess.run(cmd, check=False, capture_output=True, text=True)


def mount_or_skip(args: list[str], where: Path) -> None:
    """Mount something at `where`, skipping the test when this machine does not allow it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    where.mkdir(parents=True, exist_ok=True)
    r = sh("mount", *args, str(where))
    if r.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} failed: {r.stderr.strip()}")


def umount(where: Path) -> None:
    """Unmount, lazily if something still holds it."""
    if sh("umount", str(where)).returncode != 0:
        sh("umount", "-l", str(where))


@pytest.fixture(scope="module")
def full_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 16 MiB ext4 file system on a loop device, unmounted at teardown."""
    base = tmp_path_factory.mktemp("fullfs")
    img, mnt = base / "fs.img", base / "mnt"
    with open(img, "wb") as f:
        f.truncate(16 * MiB)
    r = sh("mkfs.ext4", "-q", "-F", str(img))
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
    mount_or_skip(["-o", "loop", str(img)], mnt)
    try:
        yield mnt
    finally:
        umount(mnt)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh ramfs mount, a file system that refuses O_DIRECT at open."""
    mnt = tmp_path / "ramfs"
    mount_or_skip(["-t", "ramfs", "ramfs"], mnt)
    try:
        yield mnt
    finally:
        umount(mnt)


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
