"""Per-process swap directories: `<dir>/deepnvme-swap-<host>-<pid>-<starttime>[-<n>]/space-<n>/`.

Several processes (the ranks of one job, or containers on one host) may share a directory: each keeps its
files in a subdirectory of its own, removed on close. A run killed before it could close leaves its
subdirectory behind; the next swap space made in that directory removes those whose owner is gone, and
never a live process's. The owner is known by a lock, not a pid (op_builder.liveness): each process holds
an exclusive flock on a file in its subdirectory while it lives, so a process in another PID namespace,
where the pid in the name means another process or none, is still seen alive. A subdirectory without the
lock file (left by a version that did not lock) falls back to the pid and start time, on this host only.

A process's subdirectory appears under its final name with the lock already held (made under a temporary
name, then renamed), so no other process ever sees it unlocked while it lives. Its name is unique on the
host among live processes: a name already taken (the same pid and start time in another PID namespace)
gets a suffix.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time

from deepnvme.offload._doors import hold_lock, lock_held, owner_alive, owner_mark

PREFIX = "deepnvme-swap-"
HOST = "".join(c if c.isalnum() or c == "_" else "_" for c in socket.gethostname()) or "host"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<start>\d+)(?:-\d+)?$")
_MAKING = re.compile(rf"^{re.escape(PREFIX)}[A-Za-z0-9_-]+\.[0-9a-f]{{8}}\.making$")
_MAKING_GRACE_S = 60.0
#: This process's subdirectories (path -> the descriptor holding its lock), guarded by _LOCK.
_HELD: dict[str, int] = {}
_LOCK = threading.Lock()


def own_name(pid: int | None = None) -> str:
    """The subdirectory name of process `pid` (default: this one), before any suffix."""
    return f"{PREFIX}{HOST}-{owner_mark(pid)}"


def is_stale(directory: str, name: str) -> bool:
    """Whether `name` in `directory` is a swap subdirectory whose owner is gone: its lock file is there and
    nobody holds it; without a lock file, a subdirectory of this host whose process no longer runs."""
    if _MAKING.match(name):  # one being made: stale once its maker is gone (lock free, or never made)
        path = os.path.join(directory, name)
        held = lock_held(path)
        if held is None:  # its maker died before locking, or is about to lock: give it a minute
            try:
                return time.time() - os.stat(path).st_mtime > _MAKING_GRACE_S
            except OSError:
                return False
        return not held
    m = _NAME.match(name)
    if m is None:
        return False
    held = lock_held(os.path.join(directory, name))
    if held is not None:
        return not held
    return m["host"] == HOST and not owner_alive(int(m["pid"]), int(m["start"]))


def remove_stale(directory: str) -> list[str]:
    """Remove the swap subdirectories of gone owners in `directory`; returns their paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if is_stale(directory, name):
            path = os.path.join(directory, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _own_directory(directory: str) -> str:
    """This process's subdirectory of `directory`, made and locked on first use (the lock held)."""
    for path, fd in list(_HELD.items()):
        if os.path.dirname(path) == directory:
            if os.path.isdir(path):
                return path
            del _HELD[path]  # removed under us (by hand): its lock goes, a new folder is made
            os.close(fd)
    base = os.path.join(directory, own_name())
    for n in range(1000):
        own = base if n == 0 else f"{base}-{n}"
        if os.path.lexists(own):
            continue  # another process's of the same pid and start time (another PID namespace), or stale
        tmp = f"{own}.{os.urandom(4).hex()}.making"
        os.mkdir(tmp, 0o700)
        fd = -1
        try:
            fd = hold_lock(tmp)
            os.rename(tmp, own)  # fails when `own` appeared meanwhile and holds anything
        except OSError:
            if fd >= 0:
                os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.lexists(own):
                continue
            raise
        _HELD[own] = fd
        return own
    raise FileExistsError(f"no free swap subdirectory name under {base}")


def make_own(directory: str) -> str:
    """Create a new, empty subdirectory `space-<n>` of this process's swap directory in `directory`.

    Each swap space of a process gets one of its own, so two spaces never share files.
    """
    with _LOCK:
        own = _own_directory(directory)
        n = 0
        while True:
            path = os.path.join(own, f"space-{n}")
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:
                n += 1


def remove_own(path: str) -> None:
    """Remove a space's subdirectory, and this process's directory (and its lock) once no space is left."""
    shutil.rmtree(path, ignore_errors=True)
    own = os.path.dirname(path)
    with _LOCK:
        try:
            if any(name.startswith("space-") for name in os.listdir(own)):
                return  # another space of this process still lives there
        except OSError:
            pass
        fd = _HELD.pop(own, -1)
        shutil.rmtree(own, ignore_errors=True)  # the lock file first goes with it, then the lock
        if fd >= 0:
            os.close(fd)


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's directories: its copies of their descriptors are closed
    (the parent keeps the locks: flock belongs to the open file, which the parent still has open)."""
    global _LOCK
    _LOCK = threading.Lock()
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
