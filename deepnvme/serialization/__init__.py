"""deepnvme.save / deepnvme.load: torch's checkpoint format at the speed of the aio_handle.

The file is torch.save's own zip archive, so stock torch.load reads what save writes and load reads what
torch.save wrote. Both are built on torch.save/torch.load themselves:

- save hands torch.save a file object (torch's writer takes any object with write()) while
  `torch.utils.serialization.config.save.storage_alignment` is 4096 in the saving thread (torch keeps
  the setting per thread), so every storage payload starts on a page. The payloads, which torch passes
  as views of the storages' own memory, go to the handle O_DIRECT and asynchronously, straight from that
  memory; the small records between them are staged in two 4 MiB page-aligned buffers. Nothing else is
  copied: the archive never exists in memory. torch's own CRC-32 (one core, slower than the disk) is
  off; the stream computes each record's CRC with zlib-ng right after queueing its write, so the CRC
  overlaps that write, and puts it where torch's zip writer leaves it zero (the data descriptor after
  the record, the central directory). The object is first pickled once into a null sink to learn which
  storages it holds, because only memory that outlives the call may be written asynchronously (torch
  makes transient host copies of device storages; those are staged, not referenced).
  The save is atomic: a temporary file in the same directory, fsync, rename over the path, fsync of the
  directory. A crash leaves the previous file intact (and at worst a temporary
  `.<name>.<host>.<pid>.<random>.deepnvme-tmp`, which the next successful save of that path removes once
  its process is gone).
- load reads the whole archive before torch.load unpickles it, in deep batches of asynchronous reads on
  two handles: every large storage payload straight into memory of its own, allocated at the payload's
  offset from a page so that the handle reads it O_DIRECT with no copy, and the rest of the file into
  one scratch buffer; a worker thread checks every record's CRC-32 (which torch.load does not, so a
  damaged file raises CheckpointFormatError naming it rather than loading garbage) while the next batch
  is read. torch.load then reads through a file object of ours: when it asks for a payload read ahead
  this way, it gets nothing, and the map_location hook hands it the storage read ahead in place of the
  one it allocated; everything else is copied out of the scratch buffer. Storage sizes, views,
  map_location and weights_only are therefore torch.load's own. Where torch would not read the payloads
  (map_location="meta") or byte-swaps them first (a big-endian file), torch's own storages are filled.

Where things are (this package's modules, internal to it: its public face is ``__all__`` and the
save and load switches named in ``_KNOBS``, below). The writing half lives in the private core, because
deepnvme.offload writes torch-format files through it too and reaches the rest of deepnvme through
``_core`` only:

- :mod:`deepnvme._core.saving`          ``save``: the temporary, the handle, the atomic replace, freeing the
                                        replaced file
- :mod:`deepnvme._core.archive_writer`  the stream torch.save writes into, its CRC-32s, the page-aligned
                                        payload setting
- :mod:`deepnvme._core.interrupts`      Ctrl-C inside torch's callbacks, found again under the error torch
                                        wraps it in (save's and load's)
- :mod:`.loading`         ``load``: torch.load over the archive read by the handles; its errors named
- :mod:`.archive_reader`  the file object torch.load reads through (on demand, or served from the prefetch)
- :mod:`.prefetch`        the whole archive read ahead in batches on two handles, CRC-32s checked beside
- :mod:`.read_errors`     what a truncated, damaged or unexpectedly laid-out archive is reported as

Importing this package does not import torch.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from deepnvme._core import archive_writer, saving
from deepnvme._core.errors import CheckpointFormatError
from deepnvme._core.files import TEMP_SUFFIX
from deepnvme._core.saving import save
from deepnvme.serialization import archive_reader, prefetch
from deepnvme.serialization.loading import load

__all__ = ["TEMP_SUFFIX", "CheckpointFormatError", "load", "save"]

# The switches and sizes of save and load, each kept in the module that reads it when a save or load runs.
# They were set on this module before it became a package (the README: `serialization.FILL_FRESH = False`,
# bench/ckpt_bench.py, tests), so reading or setting one here reads or sets it in its module: a copy here
# would be set and never read.
_KNOBS: dict[str, types.ModuleType] = {
    "STORAGE_ALIGNMENT": archive_writer,
    "STAGING_BYTES": saving,
    "READ_CHUNK_BYTES": archive_reader,
    **{name: prefetch for name in ("PREFETCH_OWN_BYTES", "BATCH_BYTES", "TAIL_BATCH_BYTES", "STAGE_PAYLOADS",
                                   "STAGED_SHIFT", "FILL_FRESH")},
}


def __getattr__(name: str) -> Any:
    """A knob of save or load, read from the module that owns it (see _KNOBS)."""
    owner = _KNOBS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(owner, name)


def __dir__() -> list[str]:
    """The knobs too, so that dir() and completion show them."""
    return sorted(set(globals()) | set(_KNOBS))


class _Face(types.ModuleType):
    """This package's module type: setting a knob on it sets it in the module that owns it (see _KNOBS)."""

    def __setattr__(self, name: str, value: Any) -> None:
        owner = _KNOBS.get(name)
        if owner is None:
            super().__setattr__(name, value)
        else:
            setattr(owner, name, value)


sys.modules[__name__].__class__ = _Face
