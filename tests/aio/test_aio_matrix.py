"""DeepSpeed's test matrix (tests/unit/v1/nvme/test_aio.py) re-done per engine, plus bigger sizes."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

BLOCK_SIZE = 1024
QUEUE_DEPTH = 2
IO_PARALLEL = 2
IO_SIZE = 4096
U8 = torch.empty(0, dtype=torch.uint8)


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def make_buffer(h, nbytes: int, locked: bool) -> torch.Tensor:
    """A uint8 buffer: locked by the handle, or plain pageable memory."""
    return h.new_cpu_locked_tensor(nbytes, U8) if locked else torch.empty(nbytes, dtype=torch.uint8)


def write_ref(path: Path, nbytes: int) -> bytes:
    """Write nbytes of random data with plain Python I/O and return them."""
    data = os.urandom(nbytes)
    path.write_bytes(data)
    return data


def new_handle(m: ModuleType, engine: str, single_submit: bool, overlap_events: bool,
               block: int = BLOCK_SIZE, qd: int = QUEUE_DEPTH, par: int = IO_PARALLEL):
    """A handle built positionally as DeepSpeed's tests do, with its state checked."""
    h = m.aio_handle(block, qd, single_submit, overlap_events, par, engine=engine)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (block, qd, single_submit, overlap_events, par)
    return h


SIZES = [IO_SIZE, 3 << 20]


@pytest.mark.parametrize("size", SIZES, ids=["4KiB", "3MiB"])
@pytest.mark.parametrize("locked", [True, False], ids=["locked", "plain"])
@pytest.mark.parametrize("overlap_events", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("single_submit", [True, False], ids=["single", "batch"])
@pytest.mark.parametrize("mode", ["sync", "async"])
class TestMatrix:
    """sync/async x single_submit x overlap_events x locked/plain, reads and writes."""

    def test_read(self, aio_module, engine, workdir, mode, single_submit, overlap_events, locked, size):
        """A read returns DeepSpeed's count and fills the buffer with the file's bytes."""
        block = BLOCK_SIZE if size == IO_SIZE else 256 << 10
        h = new_handle(aio_module, engine, single_submit, overlap_events, block=block)
        path = workdir / "ref.bin"
        data = write_ref(path, size)
        buf = make_buffer(h, size, locked)
        buf.fill_(0)
        if mode == "sync":
            assert h.sync_pread(buf, str(path)) == 1
        else:
            assert h.async_pread(buf, str(path)) == 0
            assert h.wait() == 1
        assert tbytes(buf) == data
        if locked:
            assert h.free_cpu_locked_tensor(buf) is True

    def test_write(self, aio_module, engine, workdir, mode, single_submit, overlap_events, locked, size):
        """A write returns DeepSpeed's count and produces a byte-identical new file."""
        block = BLOCK_SIZE if size == IO_SIZE else 256 << 10
        h = new_handle(aio_module, engine, single_submit, overlap_events, block=block)
        data = os.urandom(size)
        buf = make_buffer(h, size, locked)
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        out = workdir / "out.bin"
        if mode == "sync":
            assert h.sync_pwrite(buf, str(out)) == 1
        else:
            assert h.async_pwrite(buf, str(out)) == 0
            assert h.wait() == 1
        assert out.read_bytes() == data
        if locked:
            assert h.free_cpu_locked_tensor(buf) is True


@pytest.mark.parametrize("queue", [2, 3, 16])
@pytest.mark.parametrize("locked", [True, False], ids=["locked", "plain"])
def test_async_queue_read(aio_module, engine, workdir, queue: int, locked: bool) -> None:
    """Several async reads, each returning 0, are drained by one wait() returning their number."""
    h = new_handle(aio_module, engine, True, True)
    refs, bufs = [], []
    for i in range(queue):
        refs.append(write_ref(workdir / f"r{i}", IO_SIZE))
        bufs.append(make_buffer(h, IO_SIZE, locked))
    for i in range(queue):
        assert h.async_pread(bufs[i], str(workdir / f"r{i}")) == 0
    assert h.wait() == queue
    assert h.wait() == 0
    for i in range(queue):
        assert tbytes(bufs[i]) == refs[i]


@pytest.mark.parametrize("queue", [2, 3, 16])
@pytest.mark.parametrize("locked", [True, False], ids=["locked", "plain"])
def test_async_queue_write(aio_module, engine, workdir, queue: int, locked: bool) -> None:
    """Several async writes, each returning 0, are drained by one wait() returning their number."""
    h = new_handle(aio_module, engine, True, True)
    refs = [os.urandom(IO_SIZE) for _ in range(queue)]
    bufs = []
    for i in range(queue):
        b = make_buffer(h, IO_SIZE, locked)
        b.copy_(torch.frombuffer(bytearray(refs[i]), dtype=torch.uint8))
        bufs.append(b)
    for i in range(queue):
        assert h.async_pwrite(buffer=bufs[i], filename=str(workdir / f"w{i}"), file_offset=0) == 0
    assert h.wait() == queue
    for i in range(queue):
        assert (workdir / f"w{i}").read_bytes() == refs[i]


def test_sync_counts_earlier_async(aio_module, engine, workdir) -> None:
    """A sync call returns the requests it completed, queued async ones included; then wait() is 0."""
    h = new_handle(aio_module, engine, False, True)
    data = write_ref(workdir / "f", IO_SIZE)
    bufs = [torch.zeros(IO_SIZE, dtype=torch.uint8) for _ in range(3)]
    assert h.wait() == 0
    assert h.async_pread(bufs[0], str(workdir / "f")) == 0
    assert h.async_pread(bufs[1], str(workdir / "f")) == 0
    assert h.sync_pread(bufs[2], str(workdir / "f")) == 3
    assert h.wait() == 0
    assert all(tbytes(b) == data for b in bufs)
    assert h.pread(bufs[0], str(workdir / "f"), False, True) == 0
    assert h.pwrite(bufs[1], str(workdir / "g"), False, False) == 2
    assert h.wait() == 0


PARTITIONS = [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1], [3, 5, 1, 7]]


def _open_fd(path: Path, direct: bool, write: bool) -> int:
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)


@pytest.mark.parametrize("unit", [1024, 4096, 1000], ids=["1KiB", "4KiB", "1000B"])
@pytest.mark.parametrize("target", ["name", "fd", "fd_direct"])
@pytest.mark.parametrize("partitions", PARTITIONS, ids=lambda p: "-".join(map(str, p)))
@pytest.mark.parametrize("locked", [True, False], ids=["locked", "plain"])
def test_offset_write(aio_module, engine, workdir, partitions, target: str, unit: int, locked: bool) -> None:
    """A file grown partition by partition at offsets equals a Python-appended reference after each step."""
    h = new_handle(aio_module, engine, True, True)
    total = sum(partitions) * unit
    data = os.urandom(total)
    buf = make_buffer(h, total, locked)
    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    ref, out = workdir / "ref", workdir / "out"
    fd = _open_fd(out, target == "fd_direct", True) if target != "name" else -1
    try:
        offset = 0
        for part in partitions:
            n = part * unit
            with open(ref, "ab") as f:
                f.write(data[offset:offset + n])
            piece = buf.narrow(0, offset, n)
            if target == "name":
                assert h.async_pwrite(buffer=piece, filename=str(out), file_offset=offset) == 0
            else:
                assert h.async_pwrite(buffer=piece, fd=fd, file_offset=offset) == 0
            assert h.wait() == 1
            assert out.read_bytes() == ref.read_bytes()
            offset += n
        if fd >= 0:
            os.fstat(fd)  # the handle must not have closed the caller's descriptor
    finally:
        if fd >= 0:
            os.close(fd)


@pytest.mark.parametrize("unit", [1024, 4096, 1000], ids=["1KiB", "4KiB", "1000B"])
@pytest.mark.parametrize("target", ["name", "fd", "fd_direct"])
@pytest.mark.parametrize("partitions", PARTITIONS, ids=lambda p: "-".join(map(str, p)))
def test_offset_read(aio_module, engine, workdir, partitions, target: str, unit: int) -> None:
    """Reads of successive partitions at their offsets, by name or descriptor, return the reference bytes."""
    h = new_handle(aio_module, engine, True, True)
    total = sum(partitions) * unit
    path = workdir / "ref"
    data = write_ref(path, total)
    buf = h.new_cpu_locked_tensor(total, U8)
    buf.fill_(0)
    fd = _open_fd(path, target == "fd_direct", False) if target != "name" else -1
    try:
        offset = 0
        for part in partitions:
            n = part * unit
            piece = buf.narrow(0, 0, n)
            if target == "name":
                assert h.sync_pread(piece, str(path), offset) == 1
            else:
                assert h.sync_pread(piece, fd=fd, file_offset=offset) == 1
            assert tbytes(piece) == data[offset:offset + n]
            offset += n
        if fd >= 0:
            os.fstat(fd)
    finally:
        if fd >= 0:
            os.close(fd)
