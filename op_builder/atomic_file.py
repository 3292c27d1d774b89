"""Replacing a file atomically and durably: the one recipe for every file the project writes.

Write a temporary in the target's directory, fsync it, rename it over the target, fsync the directory: a
crash leaves the old file or the new one, never half of one, and the rename is not lost. A temporary is
named `.<name>.<host>.<pid>-<start time>.<random>.deepnvme-tmp`, so that a later replace of the same name on
the same host can tell the leftovers of killed processes (removed) from a replace still running in another
process (kept), by the project's one liveness rule (op_builder.liveness: pid and start time).

It lives here, in the lowest layer, because the op builders' JIT stamp is written through it as well as the
library's checkpoints (deepnvme._core.files adds the library's error wording on top); standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket

from .liveness import owner_alive, owner_mark, parse_owner_mark

__all__ = ["TEMP_SUFFIX", "close_all", "commit", "discard", "fsync_directory", "open_into",
           "remove_stale_temps", "replace_bytes", "replaced_by", "temporary_name"]

TEMP_SUFFIX = ".deepnvme-tmp"
_HOST = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname()) or "host"


def open_into(held: list[int], path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
    """os.open(path, flags, mode), the new descriptor appended to `held` before Python code runs again.

    Why: CPython runs a signal's Python handler at the first check after a call returns, and a Ctrl-C
    that arrives while open(2) runs is handled right after os.open returns, before `fd = os.open(...)`
    stores the result: the KeyboardInterrupt then loses the descriptor whatever try surrounds the line.
    list.extend over map calls os.open and stores its result without returning to the interpreter in
    between, so a caller that closes what `held` holds when it fails (close_all) never leaks one.
    """
    held.extend(map(os.open, (path,), (flags,), (mode,)))
    return held[-1]


def close_all(held: list[int]) -> None:
    """Close every descriptor in `held`, emptying it, so that no interrupt after a close(2) leaves one open
    or closes one twice (by then the number may be another file's).

    Why so: a descriptor must leave the list and be closed with no return to the interpreter in between,
    or a KeyboardInterrupt raised there leaks it (removed, not closed) or has it closed again (closed, not
    removed). iter(held.pop, None) pops from the end; map closes each as it comes; list() drives both, all
    in C, until the pop of the empty list raises IndexError. A close that fails stops there, its
    descriptor already out of the list.
    """
    try:
        list(map(os.close, iter(held.pop, None)))
    except IndexError:  # the list is empty: every descriptor is closed
        pass


def temporary_name(target: str) -> str:
    """A fresh temporary path beside `target` (same directory, hence same file system, for the rename)."""
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.{_HOST}.{owner_mark()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def replaced_by(path: str) -> str:
    """The file that temporary `path` (a :func:`temporary_name`) is to replace; any other path as it is.
    For messages: a user knows the name they gave, not the temporary's."""
    directory, name = os.path.split(path)
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return path
    parts = name[1:-len(TEMP_SUFFIX)].split(".")
    return os.path.join(directory, ".".join(parts[:-3])) if len(parts) > 3 else path


def discard(tmp: str) -> None:
    """Remove a temporary; quietly, because the error that brought us here is the one to report (on a
    read-only or vanished file system the unlink fails too)."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def commit(tmp: str, target: str, *, durable: bool = True) -> None:
    """Rename the written (and, when `durable`, fsynced) temporary over `target`, fsync the directory,
    and remove leftovers of killed processes. The temporary is gone afterwards, even when this raises."""
    try:
        os.replace(tmp, target)
    except BaseException:
        discard(tmp)
        raise
    directory, name = os.path.split(target)
    if durable:
        fsync_directory(directory or ".")
    remove_stale_temps(directory or ".", name)


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable. Some file systems refuse fsync on a directory (EINVAL,
    ENOTSUP): there is nothing more to do there. Other errors carry the directory as their filename."""
    held: list[int] = []
    try:
        fd = open_into(held, directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise type(exc)(exc.errno, exc.strerror, directory) from exc
    finally:
        close_all(held)


def remove_stale_temps(directory: str, name: str) -> None:
    """Delete temporaries of `name` that this host's processes left and that are no longer running."""
    prefix = f".{name}.{_HOST}."
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not (entry.name.startswith(prefix) and entry.name.endswith(TEMP_SUFFIX)):
                continue
            owner = parse_owner_mark(entry.name[len(prefix):].split(".", 1)[0])
            if owner is not None and not owner_alive(*owner):
                discard(entry.path)


def replace_bytes(path: str, data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Replace `path` with `data` by the recipe above. On failure the temporary is gone, `path` is
    untouched and the OSError raised is the one that made it fail."""
    tmp = temporary_name(path)
    held: list[int] = []
    try:
        try:
            fd = open_into(held, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            close_all(held)
    except BaseException:
        discard(tmp)
        raise
    commit(tmp, path, durable=durable)

