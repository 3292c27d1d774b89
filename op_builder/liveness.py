"""Whether the process that left something behind (a temporary file, a swap directory) still runs: the one
rule for every owner mark the project writes.

A pid alone cannot say: pids are reused, so the leftover of a killed process whose pid another process now
holds would look alive, and be kept for ever. An owner is therefore marked by its pid and its start time
(field 22 of /proc/<pid>/stat, clock ticks since boot), and is alive while a process with that pid,
started at that time, runs. Where /proc cannot be read at all, the start time is unknown (0 in a mark) and
the rule falls back to the pid: better to keep a dead process's leftovers than remove a live one's files.

A directory that a process works in for a long time (a swap folder) is held instead by a lock: the owner
creates `OWNER_LOCK` in it and keeps an exclusive flock on it while it lives; the kernel drops the lock when
the process dies, however it dies. Unlike a pid, a lock means the same to every process that can open the
file: containers on one host (each its own PID namespace, where the owner's pid names another process or
none) sharing a folder no longer take each other for dead. `lock_held` is the question, `hold_lock` the
answer's other side; a directory without the file (made by a version that did not lock) falls back to the
pid rule above.

It lives in op_builder, the lowest layer, because op_builder.atomic_file (the JIT stamp's and the
checkpoints' temporaries) uses it; deepnvme._core.files re-exports it for the library (the swap
directories). Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["OWNER_LOCK", "hold_lock", "lock_held", "owner_alive", "owner_mark", "parse_owner_mark",
           "start_time"]

#: The file in a held directory whose flock says its owner lives.
OWNER_LOCK = ".deepnvme-owner.lock"


def start_time(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22); None if there
    is no such process (or no /proc to ask)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def owner_mark(pid: int | None = None) -> str:
    """`<pid>-<start time>` of process `pid` (default: this one), as names that record an owner hold it."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{start_time(pid) or 0}"


def parse_owner_mark(text: str) -> tuple[int, int | None] | None:
    """(pid, start time) from an :func:`owner_mark`; a bare pid (names written before start times were
    kept) gives start None; anything else None."""
    pid, dash, start = text.partition("-")
    if not pid.isdigit() or (dash and not start.isdigit()):
        return None
    return int(pid), int(start) if dash else None


def owner_alive(pid: int, start: int | None) -> bool:
    """Whether the owner marked (`pid`, `start`) still runs: a process `pid` that started at `start`.

    `start` None (a mark with a pid only) or 0 (its start time was unknown) asks for the pid alone.
    """
    now = start_time(pid)
    if now is not None:
        return not start or now == start
    if start_time(os.getpid()) is not None:
        return False  # /proc answers, and has no such process
    try:  # no /proc here: the pid is all there is to ask about
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def hold_lock(directory: str) -> int:
    """Create `directory`/OWNER_LOCK and take an exclusive flock on it: the returned descriptor holds it
    until closed (or the process ends). BlockingIOError when another open file description holds it;
    OSError naming the file otherwise. The descriptor is not inherited by exec'd programs; a forked child
    shares the lock until it closes its copy."""
    # Locked under a name of its own, then renamed (the lock stays with the open file): whoever opens
    # OWNER_LOCK finds it held from its first moment.
    path = os.path.join(directory, OWNER_LOCK)
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def lock_held(directory: str) -> bool | None:
    """Whether a live process holds `directory`'s owner lock: True (held, or it cannot be told: keep it),
    False (the file is there and nobody holds it: its owner is gone), None (no lock file: ask the pid
    rule)."""
    try:  # read-write: NFS emulates flock with fcntl locks, whose exclusive kind needs a writable file
        fd = os.open(os.path.join(directory, OWNER_LOCK), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # dropped when fd closes, just below
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
