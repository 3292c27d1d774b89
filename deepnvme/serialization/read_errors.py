"""What load reports when reading an archive goes wrong: a truncated or damaged file names itself, and an
archive not laid out as torch's writer lays one out is read again exactly. Shared by the on-demand reader
(archive_reader) and the prefetch."""

from __future__ import annotations

import os

from deepnvme._core.errors import CheckpointFormatError, with_path
from deepnvme._core.zipformat import Record


class Mispredicted(Exception):
    """A member's data did not start where read_records inferred: the archive must be read exactly."""


def read_failure(exc: OSError | ValueError, fd: int, path: str, size: int) -> Exception:
    """What a failed read of the `size`-byte archive at `path` (open as `fd`) is reported as.

    A file that got shorter after load measured it is a truncated checkpoint, whatever the failed read
    said: the handle reports a read that meets the new end as EIO ("short transfer"), which would read as
    a failing disk, and refuses one that starts past it with a ValueError. Otherwise an OSError names the
    path (the handle names a descriptor) and a ValueError is the file's fault.
    """
    try:
        now = os.fstat(fd).st_size
    except OSError:
        now = size
    if now < size:
        return CheckpointFormatError(path, f"truncated while being read: the file got shorter, {now} bytes "
                                     f"now, {size} when the load began")
    if isinstance(exc, CheckpointFormatError):
        return exc
    if isinstance(exc, OSError):
        return exc if exc.filename == path else with_path(exc, path, "reading")
    return CheckpointFormatError(path, f"truncated while being read ({exc})")


def crc_error(path: str, record: Record, crc: int) -> CheckpointFormatError:
    return CheckpointFormatError(path, f"damaged: the CRC-32 of {record.name} does not match "
                                 f"(stored {record.crc:#010x}, read {crc:#010x})")
