"""Per-process swap directories: `<dir>/deepnvme-swap-<host>-<pid>-<starttime>/space-<n>/`.

Several processes (the ranks of one job) may share a directory: each keeps its files in its own
subdirectory, removed on close. A run killed before it could close leaves its subdirectory behind; the next
swap space made in that directory on the same host removes those whose process is gone (no such pid, or a
pid reused by a process that started at another time: the project's one liveness rule, _core's
owner_alive), and never a live process's.
"""

from __future__ import annotations

import os
import re
import shutil
import socket

from deepnvme.offload._doors import owner_alive, owner_mark

PREFIX = "deepnvme-swap-"
HOST = "".join(c if c.isalnum() or c == "_" else "_" for c in socket.gethostname()) or "host"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<start>\d+)$")


def own_name(pid: int | None = None) -> str:
    """The subdirectory name of process `pid` (default: this one)."""
    return f"{PREFIX}{HOST}-{owner_mark(pid)}"


def is_stale(name: str) -> bool:
    """Whether `name` is a swap subdirectory of this host whose process no longer runs."""
    m = _NAME.match(name)
    if m is None or m["host"] != HOST:
        return False
    return not owner_alive(int(m["pid"]), int(m["start"]))


def remove_stale(directory: str) -> list[str]:
    """Remove the swap subdirectories of dead processes of this host in `directory`; returns their paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if is_stale(name):
            path = os.path.join(directory, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_own(directory: str) -> str:
    """Create a new, empty subdirectory `space-<n>` of this process's swap directory in `directory`.

    Each swap space of a process gets one of its own, so two spaces never share files.
    """
    own = os.path.join(directory, own_name())
    os.makedirs(own, 0o700, exist_ok=True)
    n = 0
    while True:
        path = os.path.join(own, f"space-{n}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            n += 1


def remove_own(path: str) -> None:
    """Remove a space's subdirectory, and this process's directory once no space is left in it."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:  # another space of this process still lives there
        pass
