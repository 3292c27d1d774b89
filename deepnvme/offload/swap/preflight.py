"""Checks made before a swap space does any work; each error names the value and what to change.

- locked memory: the pool locks `budget_bytes`; without CAP_IPC_LOCK, RLIMIT_MEMLOCK must allow it;
- free space: what will be written must fit on the drive (checked again when space is reserved);
- the directory: made with its parents when missing, then it must be writable; where the file system
  refuses O_DIRECT, I/O goes buffered with the project's usual warning.
"""

from __future__ import annotations

import errno
import operator
import os

from deepnvme.offload._doors import PAGE, has_cap_ipc_lock, memlock_limit, open_maybe_direct

__all__ = ["budget_arg", "check_free_space", "check_memlock", "check_writable", "directory_arg",
           "has_cap_ipc_lock", "open_direct"]


def directory_arg(directory: object) -> str:
    """`directory` as a path string (a str or os.PathLike, not empty), else TypeError or ValueError naming
    directory."""
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must name the folder the swap files go in (a str or os.PathLike), got "
                        f"{type(directory).__name__}")
    path = os.fspath(directory)
    if not isinstance(path, str) or path == "":
        raise ValueError(f"directory must name the folder the swap files go in, got {directory!r}")
    return path


def budget_arg(budget_bytes: object) -> int:
    """`budget_bytes` as an int: any integral (numpy's too, through operator.index; not a bool), from a
    page to the machine's memory (locked memory cannot be more; past a size_t the C++ pool could not even
    be asked), else TypeError or ValueError naming budget_bytes."""
    if isinstance(budget_bytes, bool):
        raise TypeError("budget_bytes must be an int, got bool")
    try:
        budget = operator.index(budget_bytes)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}") from None
    if budget < PAGE:
        raise ValueError(f"budget_bytes={budget} is below a page ({PAGE} bytes): pass the bytes of "
                         "locked memory offload may use, at least the largest unit")
    memory = os.sysconf("SC_PHYS_PAGES") * PAGE
    if budget > memory:
        raise ValueError(f"budget_bytes={budget} is more than this machine's memory ({memory} bytes): "
                         "pass the bytes of locked memory offload may use")
    return budget


def check_memlock(budget_bytes: int, already_locked: int = 0, *, limit: int | None = None,
                  privileged: bool | None = None) -> None:
    """Raise ValueError when locking `budget_bytes` more would pass RLIMIT_MEMLOCK.

    `limit` and `privileged` default to this process's soft limit and CAP_IPC_LOCK (_core's memlock_limit).
    """
    limit = memlock_limit(limit, privileged)
    if limit is None:
        return
    if already_locked + budget_bytes > limit:
        room = max(0, limit - already_locked) // PAGE * PAGE
        raise ValueError(
            f"budget_bytes={budget_bytes} would be locked, but RLIMIT_MEMLOCK is {limit} bytes "
            f"({already_locked} already locked in this process): pass budget_bytes <= {room}, or raise the "
            f"limit (`ulimit -l {-(-(already_locked + budget_bytes) // 1024)}` or more, 'memlock' in "
            "/etc/security/limits.conf, `docker run --ulimit memlock=-1`)")


def check_free_space(directory: str, nbytes: int) -> None:
    """Raise OSError(ENOSPC) naming `directory` when fewer than `nbytes` are free there."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise OSError(errno.ENOSPC, f"{nbytes} bytes are to be written but only {free} are free there: "
                      "free space or choose another directory", directory)


def check_writable(directory: str) -> None:
    """Create `directory` with its parents when missing (as torch's DCP FileSystemWriter, accelerate's
    offload_folder and DeepSpeed's swappers do, so code moved from them runs), then raise the OSError
    (EACCES, EROFS, ENOTDIR...) that making a file there gives, naming the directory."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, "the swap directory exists and is not a directory", directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        code = exc.errno or errno.EIO
        raise OSError(code, f"{os.strerror(code)}: cannot create the swap directory (or a parent: "
                      f"{exc.filename})", directory) from exc
    probe = os.path.join(directory, f".deepnvme-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise OSError(exc.errno, f"{os.strerror(exc.errno or errno.EIO)}: swap directory not writable; "
                      "choose a writable directory", directory) from exc
    os.close(fd)
    os.unlink(probe)


def open_direct(path: str, flags: int, mode: int = 0o600) -> tuple[int, bool]:
    """Open `path` with O_DIRECT; where the file system refuses it, buffered with the project's one warning
    (_core's open_maybe_direct: the rule every opener follows). Returns (fd, direct)."""
    return open_maybe_direct(path, flags, mode)
