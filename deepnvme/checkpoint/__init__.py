"""A torch.distributed.checkpoint storage backend whose tensor bytes move through an aio_handle with O_DIRECT.

`AioStorageWriter` / `AioStorageReader` are drop-in replacements for DCP's `FileSystemWriter` /
`FileSystemReader` and keep their on-disk format exactly: a pickled `.metadata` plus `__{rank}_{i}.distcp`
files in which every item is a complete `torch.save` archive at the offset and length the metadata names.
Stock DCP (and `format_utils.dcp_to_torch_save`) reads what this writer writes, and this reader reads what
stock DCP writes.

Why it is faster: the stock writer pickles each tensor with `torch.save` into a buffered Python file and the
stock reader `torch.load`s each item from a buffered file. Here each tensor's archive is laid out with
`torch.serialization.skip_data` (only its few small records are built in memory), padding between items puts
every large payload on a 4 KiB file offset, and the payload goes from the tensor's memory to the file through
the handle (O_DIRECT, overlapped with laying out the next archives; the handle stages through its pool only
when the tensor's address is not aligned). The gaps between payloads are
whole aligned blocks, so nothing is written through the page cache. Loading reads each payload straight into
the tensor it belongs to whenever the saved chunk and the target line up, and through one temporary
otherwise (resharding). Payload CRC32s are not computed, as with
`torch.serialization.set_crc32_options(False)`; torch.load does not check them.

Where things are (this package's modules, internal to it: its public face is ``__all__``, below):

- :mod:`.writer`          ``AioStorageWriter``: files laid out and written through the handle, committed
- :mod:`.archive_layout`  one tensor's torch.save archive laid out around its payload's hole
- :mod:`.reader`          ``AioStorageReader``: archives' ends read ahead, payloads read into their tensors
- :mod:`.metadata`        ``.metadata`` read with a restricted unpickler and written atomically; storage
                          locations checked; ``checkpoint_files``
- :mod:`.io_handle`       which aio_handle the writer and reader use, and draining it
"""

from __future__ import annotations

from deepnvme.checkpoint.metadata import checkpoint_files
from deepnvme.checkpoint.reader import AioStorageReader
from deepnvme.checkpoint.writer import ALIGNMENT, INLINE_BELOW, AioStorageWriter

__all__ = ["ALIGNMENT", "INLINE_BELOW", "AioStorageReader", "AioStorageWriter", "checkpoint_files"]
