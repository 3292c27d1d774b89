"""File offsets beyond 4 GiB on every engine, in sparse files: an offset cut to 32 bits anywhere (an engine's
submit, an edge transfer, the staging path) puts the bytes in the wrong place, which a round trip through the
same cut would hide, so every check reads the file at the true offset with os.pread instead."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

GiB = 1 << 30
BLOCK = 4096
U8 = torch.empty(0, dtype=torch.uint8)

# (file offset, bytes): aligned above 4 GiB; unaligned at both ends; and across the 4 GiB line itself.
CASES = [(4 * GiB + BLOCK, 3 * BLOCK), (5 * GiB + 3, 5 * BLOCK + 7), (4 * GiB - 2 * BLOCK + 5, 5 * BLOCK)]


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous uint8 tensor."""
    return t.contiguous().numpy().tobytes()


def buffer(h, nbytes: int, memory: str) -> torch.Tensor:
    """A locked tensor (direct I/O from the tensor) or a misaligned plain one (staged)."""
    if memory == "locked":
        return h.new_cpu_locked_tensor(nbytes, U8)
    return torch.empty(nbytes + 1, dtype=torch.uint8)[1:]


def pread_at(path: Path, nbytes: int, offset: int) -> bytes:
    """Bytes of the file at a 64-bit offset, read without deepnvme."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("memory", ["locked", "misaligned"])
@pytest.mark.parametrize("case", CASES, ids=["aligned", "unaligned", "across-4GiB"])
def test_sparse_round_trip_above_4gib(aio_module: ModuleType, engine: str, workdir: Path, memory: str,
                                      case: tuple[int, int]) -> None:
    """A write lands at its 64-bit offset and nowhere else; a read takes the bytes from there."""
    offset, nbytes = case
    h = aio_module.aio_handle(BLOCK, 8, False, True, 2, engine=engine)
    path = workdir / "sparse"
    data = os.urandom(nbytes)
    src = buffer(h, nbytes, memory)
    src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert h.sync_pwrite(src, str(path), offset) == 1
    assert path.stat().st_size == offset + nbytes
    assert pread_at(path, nbytes, offset) == data
    # Where a 32-bit cut would have put it (offset mod 4 GiB) the file is still a hole.
    low = offset % (4 * GiB)
    if low + nbytes <= offset:
        assert pread_at(path, nbytes, low) == bytes(nbytes)
    assert path.stat().st_blocks * 512 < 64 * BLOCK + 2 * nbytes  # still sparse: nothing else was written

    other = os.urandom(nbytes)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, other, offset)
    finally:
        os.close(fd)
    dst = buffer(h, nbytes, memory)
    dst.fill_(0x5A)
    assert h.sync_pread(dst, str(path), offset) == 1
    assert tbytes(dst) == other
    assert h.async_pread(dst, str(path), offset) == 0 and h.wait() == 1
    assert tbytes(dst) == other
