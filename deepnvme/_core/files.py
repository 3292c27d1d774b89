"""Files as every checkpoint writer and reader of the library opens and replaces them.

One recipe for replacing a file atomically, used by deepnvme.save, the DCP writer's data and metadata
files and the MoE checkpoint's `latest`: write a temporary in the target's directory, fsync it, rename it
over the target, fsync the directory; a crash leaves the old file or the new one, never half of one. A
temporary is named `.<name>.<host>.<pid>.<random>.deepnvme-tmp`, so that a later replace of the same name
on the same host can tell the leftovers of killed processes (removed) from a save still running in
another process (kept). Errors name the caller's path, never the temporary, and a failing cleanup never
hides the error that made it necessary.

And one way to open a file for reading that never blocks on a FIFO or a device and refuses anything but
a regular file, checked on the descriptor itself (fstat after open: no window for a swap).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
from collections.abc import Iterator

from deepnvme._core.errors import with_path

__all__ = ["TEMP_SUFFIX", "atomic_target", "commit", "discard", "fsync_directory", "open_regular",
           "remove_stale_temps", "temporary_name", "write_atomically"]

TEMP_SUFFIX = ".deepnvme-tmp"
_HOST = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname()) or "host"


def temporary_name(target: str) -> str:
    """A fresh temporary path beside `target` (same directory, hence same file system, for the rename)."""
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


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


@contextlib.contextmanager
def atomic_target(path: str, *, durable: bool = True) -> Iterator[str]:
    """Yield a temporary path to write `path`'s new content to, then commit it (see commit()).

    The body writes and, when `durable`, fsyncs the temporary. If it raises, the temporary is removed
    and an OSError is raised again naming `path` (same errno); `path` itself is untouched.
    """
    tmp = temporary_name(path)
    try:
        yield tmp
        commit(tmp, path, durable=durable)
    except OSError as exc:
        discard(tmp)
        if exc.filename in (tmp, None) or exc.filename == path:
            raise with_path(exc, path) from exc
        raise  # an error about another file (the directory's fsync names the directory)
    except BaseException:
        discard(tmp)
        raise


def write_atomically(path: str, data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically (see the module): for small files such as `latest`."""
    with atomic_target(path, durable=durable) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable. Some file systems refuse fsync on a directory (EINVAL,
    ENOTSUP): there is nothing more to do there. Other errors carry the directory as their filename."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise type(exc)(exc.errno, exc.strerror, directory) from exc
    finally:
        os.close(fd)


def remove_stale_temps(directory: str, name: str) -> None:
    """Delete temporaries of `name` that this host's processes left and that are no longer running."""
    prefix = f".{name}.{_HOST}."
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not (entry.name.startswith(prefix) and entry.name.endswith(TEMP_SUFFIX)):
                continue
            pid_text = entry.name[len(prefix):].split(".", 1)[0]
            if pid_text.isdigit() and int(pid_text) != os.getpid() and not _process_exists(int(pid_text)):
                discard(entry.path)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at `path`.

    O_NONBLOCK keeps open() from waiting for a FIFO's writer (or a device's carrier); fstat on the opened
    descriptor then refuses whatever is not a regular file: IsADirectoryError for a directory, OSError
    EINVAL naming the path for a FIFO, socket or device. The non-blocking flag is cleared again (it means
    nothing to a regular file's reads, but the descriptor may be handed on).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket or device?), not read", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
