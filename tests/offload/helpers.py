"""Helpers of the offload tests: small mounts of a chosen kind, open descriptors, a forked child."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from forks import reap_child
from mounts import mounted

HANG = 60.0  # seconds: far beyond what a test's child does; reaching it means a hang


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


def in_forked_child(body: Callable[[], None]) -> str:
    """Run `body` in an os.fork() child (torch limited to one thread there: its pool does not survive fork);
    "ok" or the child's error as text. A child still running after HANG seconds is killed and fails."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's atexit handlers
        os.close(r)
        try:
            torch.set_num_threads(1)
            body()
            msg = "ok"
        except BaseException:  # noqa: BLE001 - reported to the parent
            msg = traceback.format_exc()
        os.write(w, msg.encode()[-4000:])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        code = reap_child(pid, HANG, 0.05)
        return f.read().decode() or f"the child exited with status {code} and said nothing"


def flip_byte(path: str | os.PathLike, offset: int) -> None:
    """Invert the low bit of the byte at `offset` of `path` (to the disk): damage a test expects found."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old[0] ^ 1]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
