"""deepnvme.save: torch.save into an O_DIRECT temporary through the handle, committed by atomic replace; the
file it replaces is freed off the caller's thread. How the archive itself is written: archive_writer."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import stat
import threading
from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.archive_writer import SaveStream, page_aligned_storages, storages_of
from deepnvme._core.checks import check_path
from deepnvme._core.direct import AlignedWriter, close_pair, open_for_write
from deepnvme._core.errors import with_path
from deepnvme._core.files import close_all, commit, discard, open_into, temporary_name
from deepnvme._core.handles import checkpoint_handle
from deepnvme._core.interrupts import interruption, interrupts_noted
from deepnvme._core.memory import aligned_buffer

# Each of the two staging buffers for the small records between payloads.
STAGING_BYTES = 4 << 20


def save(obj: Any, path: str | os.PathLike, pickle_module: Any = pickle, pickle_protocol: int = 2, *,
         handle: AioHandle | None = None, checksum: bool = True, payloads: Any = None) -> None:
    """torch.save(obj) to `path` atomically, storage payloads written O_DIRECT from the tensors' memory.

    `handle` is an aio_handle (default: this thread's own for checkpoints in that directory, see
    deepnvme.defaults.checkpoint_settings(): a tuned file there or the process's, else 8 MiB blocks).
    Raises FileNotFoundError when the directory is missing, IsADirectoryError when `path` is a directory,
    OSError (errno, path) when a write fails — ENOSPC included — and pickling errors as torch.save does; in
    every case a file that was at `path` before is left as it was. `checksum=False` leaves every record's
    CRC-32 zero, as torch does with compute_crc32 off: stock torch.load still reads the file, but neither zip
    tools nor deepnvme.load can then check it. A symbolic link at `path` is written through, as torch.save
    does: its target is atomically replaced and the link stays.

    `payloads` lets a caller supply storage bytes that are not in memory (deepnvme.offload streams an
    optimizer's state from its swap file this way): called with each storage of `obj` as torch writes
    it, it returns a uint8 tensor holding that storage's bytes, an iterator of uint8 tensors holding them
    one after another (a storage larger than the memory supplying it), or None to write the storage's own.
    Each tensor is written before the next is asked for, so its memory may be reused then.
    """
    import torch

    path = check_path("path", path)
    # A symbolic link is written through, as torch.save does: its target is replaced and the link kept.
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, f"no such directory {directory!r}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    storages = storages_of(obj, pickle_module, pickle_protocol)  # pickling errors surface before any file
    _join_closers()
    handle = checkpoint_handle(directory) if handle is None else handle
    tmp = temporary_name(target)
    # Allocated before the temporary exists, so a failure here (ENOMEM from the mmap) leaves nothing behind.
    buffers = [aligned_buffer(STAGING_BYTES, path) for _ in range(2)]
    direct_fd = buffered_fd = -1
    replaced: list[int] = []  # the file this replaces, held open (see _hold_replaced)
    try:
        writer = None
        try:
            direct_fd, buffered_fd = open_for_write(tmp, os.O_CREAT | os.O_EXCL, 0o666)
            writer = AlignedWriter(handle, direct_fd, buffered_fd, buffers)
            # torch's own CRC-32 (one core, slower than the disk) is off; the stream computes them faster.
            with page_aligned_storages(crc=False) as settable:
                stream = SaveStream(writer, storages, checksums=checksum and settable, payloads=payloads)
                noted: list[BaseException] = []
                try:
                    with interrupts_noted() as noted:
                        torch.save(obj, stream, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
                except BaseException as exc:
                    first = stream.error or (noted[0] if noted else None) or interruption(exc)
                    if first is None or first is exc:
                        raise
                    raise first from None  # torch's RuntimeError only follows from it
            stream.close_archive()
            writer.finish()
            os.ftruncate(buffered_fd, stream.pos)
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(buffered_fd, stat.S_IMODE(os.stat(target).st_mode))  # keep a replaced file's mode
            os.fsync(buffered_fd)
        except BaseException:
            if writer is not None:  # queued writes read the staging buffers: they must end before those go
                writer.abandon()
            raise
        finally:
            close_pair(direct_fd, buffered_fd)
        _hold_replaced(target, replaced)
        commit(tmp, target)
    except OSError as exc:
        discard(tmp)  # never raises: the error to report is this one, under the caller's name for the file
        raise with_path(exc, path) from exc
    except BaseException:
        discard(tmp)
        raise
    finally:
        _close_later(replaced)


def _hold_replaced(target: str, held: list[int]) -> None:
    """Open the regular file at `target`, if there is one, into `held` (the caller closes it with
    _close_later, whatever happens: see open_into). While it is open, the rename over the file does not
    free its blocks (for a large file that takes a file system hundreds of milliseconds); _close_later
    frees them off the caller's thread."""
    try:
        fd = open_into(held, target, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        close_all(held)


_closers: set[threading.Thread] = set()


def _join_closers() -> None:
    """Wait until the files earlier saves replaced are freed (a save should not find the disk fuller)."""
    for closer in list(_closers):
        closer.join()
        _closers.discard(closer)


def _close_later(held: list[int]) -> None:
    """Close what `held` holds on a thread of its own (see _hold_replaced)."""
    if not held:
        return

    closer = threading.Thread(target=_close_quietly, args=(held,), name="deepnvme-free-replaced", daemon=True)
    closer.start()
    _closers.add(closer)  # started first: a concurrent _join_closers may join anything in the set


def _close_quietly(held: list[int]) -> None:
    with contextlib.suppress(OSError):
        close_all(held)
