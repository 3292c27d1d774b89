"""Any size, offset, dtype, shape and parallelism; read/write/aio_read/aio_write; pwrite semantics."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import ModuleType

import pytest
import torch

MiB = 1 << 20
U8 = torch.empty(0, dtype=torch.uint8)
SIZES = [1, 511, 512, 4095, 4096, 4097, 6144, MiB + 1]
OFFSETS = [0, 1, 511, 4096, 4097, 12345]


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fill(t: torch.Tensor, data: bytes) -> None:
    """Copy raw bytes into a contiguous tensor of any dtype."""
    t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def buffer(h, nbytes: int, kind: str) -> torch.Tensor:
    """A uint8 buffer that is locked, plain, or plain and deliberately misaligned by one byte."""
    if kind == "locked":
        return h.new_cpu_locked_tensor(max(nbytes, 1), U8)[:nbytes]
    if kind == "misaligned":
        return torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    return torch.empty(nbytes, dtype=torch.uint8)


@pytest.mark.parametrize("kind", ["locked", "plain", "misaligned"])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_unaligned_roundtrip(aio_module: ModuleType, engine: str, workdir: Path, size: int, offset: int,
                             kind: str) -> None:
    """Write then read any size at any offset into a file holding other data; neighbours stay intact."""
    h = aio_module.aio_handle(4096, 8, False, True, 2, engine=engine)
    path = workdir / "f"
    before = os.urandom(offset + size + 777)
    path.write_bytes(before)
    data = os.urandom(size)
    src = buffer(h, size, kind)
    fill(src, data)
    assert h.sync_pwrite(src, str(path), offset) == 1
    expect = before[:offset] + data + before[offset + size:]
    assert path.read_bytes() == expect
    dst = buffer(h, size, kind)
    dst.fill_(0)
    assert h.sync_pread(dst, str(path), offset) == 1
    assert tbytes(dst) == data


@pytest.mark.parametrize("par", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [5 * MiB + 123, 7 * MiB - 1], ids=["5MiB+123", "7MiB-1"])
def test_large_uneven(aio_module: ModuleType, engine: str, workdir: Path, par: int, size: int) -> None:
    """Multi-MiB sizes that do not divide by P are split unevenly and round-trip exactly (sync and async)."""
    h = aio_module.aio_handle(MiB, 32, False, True, par, engine=engine)
    data = os.urandom(size)
    src = torch.empty(size, dtype=torch.uint8)
    fill(src, data)
    path = workdir / "big"
    assert h.async_pwrite(src, str(path), 3) == 0
    assert h.wait() == 1
    raw = path.read_bytes()
    assert raw[:3] == b"\0\0\0" and raw[3:] == data
    dst = h.new_cpu_locked_tensor(size, U8)
    dst.fill_(0)
    assert h.sync_pread(dst, str(path), 3) == 1
    assert tbytes(dst) == data


@pytest.mark.parametrize("par", [1, 2, 3, 4])
@pytest.mark.parametrize("block", [512, 1000, 4096, 65536])
def test_parallelism_and_block_sizes(aio_module: ModuleType, engine: str, workdir: Path, par: int,
                                     block: int) -> None:
    """Every P from 1 to 4 with various block sizes (even ones that are not sector multiples) is exact."""
    h = aio_module.aio_handle(block, 4, False, False, par, engine=engine)
    size = 3 * 65536 + 5
    data = os.urandom(size)
    src = h.new_cpu_locked_tensor(size, U8)
    fill(src, data)
    path = workdir / "p"
    assert h.sync_pwrite(src, str(path)) == 1
    assert path.read_bytes() == data
    dst = torch.zeros(size, dtype=torch.uint8)
    assert h.async_pread(dst, str(path)) == 0
    assert h.wait() == 1
    assert tbytes(dst) == data


DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool]
SHAPES = [(4099,), (17, 33), (3, 5, 257)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_shapes(aio_module: ModuleType, engine: str, workdir: Path, dtype, shape) -> None:
    """Tensors of any dtype and shape are written and read as their raw bytes."""
    h = aio_module.aio_handle(4096, 4, False, False, 2, engine=engine)
    src = torch.empty(shape, dtype=dtype)
    data = os.urandom(src.numel() * src.element_size())
    if dtype == torch.bool:
        data = bytes(b & 1 for b in data)
    fill(src, data)
    path = workdir / "t"
    assert h.sync_pwrite(src, str(path), 100) == 1
    assert path.read_bytes()[100:] == data
    dst = torch.zeros(shape, dtype=dtype)
    assert h.sync_pread(dst, str(path), 100) == 1
    assert tbytes(dst) == data
    locked = h.new_cpu_locked_tensor(src.numel(), src).view(shape)
    assert h.sync_pread(locked, str(path), 100) == 1
    assert tbytes(locked) == data


@pytest.mark.parametrize("size", [1, 4095, 4096, 6144, MiB + 1])
@pytest.mark.parametrize("offset", [0, 1, 4096])
def test_read_write_methods(aio_module: ModuleType, engine: str, workdir: Path, size: int,
                            offset: int) -> None:
    """handle.read/handle.write transfer buffer.nbytes at file_offset and return 0 (DeepSpeed's value)."""
    h = aio_module.aio_handle(4096, 8, True, False, 1, engine=engine)
    path = workdir / "rw"
    base = os.urandom(offset + size + 10)
    path.write_bytes(base)
    data = os.urandom(size)
    src = torch.empty(size, dtype=torch.uint8)
    fill(src, data)
    assert h.write(src, str(path), False, offset) == 0
    assert path.read_bytes() == base[:offset] + data + base[offset + size:]
    dst = torch.zeros(size, dtype=torch.uint8)
    assert h.read(dst, str(path), False, offset) == 0
    assert tbytes(dst) == data
    assert h.read(dst, str(path), True, offset) == 0
    assert h.write(src, str(path), True, offset) == 0
    assert h.wait() == 0


@pytest.mark.parametrize("single_submit", [True, False])
@pytest.mark.parametrize("overlap_events", [True, False])
@pytest.mark.parametrize("size", [4096, 4097, 3 * MiB + 5])
def test_module_functions(aio_module: ModuleType, workdir: Path, size: int, single_submit: bool,
                          overlap_events: bool) -> None:
    """aio_write/aio_read (positional, DeepSpeed's order) write and read buffer.nbytes at offset 0."""
    path = workdir / "m"
    data = os.urandom(size)
    src = torch.empty(size, dtype=torch.uint8)
    fill(src, data)
    assert aio_module.aio_write(src, str(path), 65536, 8, single_submit, overlap_events, False) == 0
    assert path.read_bytes() == data
    dst = torch.zeros(size, dtype=torch.uint8)
    assert aio_module.aio_read(dst, str(path), 65536, 8, single_submit, overlap_events, True) == 0
    assert tbytes(dst) == data


def test_writes_never_truncate(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Writing a short buffer over a longer file keeps the tail (pwrite semantics, as DeepSpeed)."""
    h = aio_module.aio_handle(4096, 4, False, False, 2, engine=engine)
    path = workdir / "long"
    old = os.urandom(3 * 4096 + 100)
    path.write_bytes(old)
    new = os.urandom(4096)
    src = torch.empty(4096, dtype=torch.uint8)
    fill(src, new)
    assert h.sync_pwrite(src, str(path)) == 1
    assert path.read_bytes() == new + old[4096:]
    assert h.write(src[:100], str(path), False, 0) == 0
    assert aio_module.aio_write(src[:10], str(path), 4096, 4, False, False, False) == 0
    assert path.read_bytes() == new + old[4096:]


def test_write_past_end_leaves_hole(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Writing beyond EOF extends the file with zeros before the new data."""
    h = aio_module.aio_handle(4096, 4, False, False, 1, engine=engine)
    path = workdir / "hole"
    path.write_bytes(b"abc")
    src = torch.full((5000,), 7, dtype=torch.uint8)
    assert h.sync_pwrite(src, str(path), 10000) == 1
    raw = path.read_bytes()
    assert raw == b"abc" + bytes(10000 - 3) + bytes([7]) * 5000


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_new_file_mode(aio_module: ModuleType, engine: str, workdir: Path, mask: int) -> None:
    """New files get 0666 & ~umask, like open(2) callers expect (DeepSpeed used 0600)."""
    h = aio_module.aio_handle(4096, 4, False, False, 1, engine=engine)
    src = torch.zeros(4096, dtype=torch.uint8)
    old = os.umask(mask)
    try:
        assert h.sync_pwrite(src, str(workdir / "a")) == 1
        assert h.write(src, str(workdir / "b"), False) == 0
        assert h.async_pwrite(src, str(workdir / "c")) == 0
        assert h.wait() == 1
    finally:
        os.umask(old)
    for name in "abc":
        assert stat.S_IMODE((workdir / name).stat().st_mode) == 0o666 & ~mask, name


def test_zero_bytes(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Zero-byte transfers succeed, count as requests and change nothing."""
    h = aio_module.aio_handle(4096, 4, False, False, 2, engine=engine)
    path = workdir / "z"
    path.write_bytes(b"xyz")
    empty = torch.empty(0, dtype=torch.uint8)
    assert h.sync_pwrite(empty, str(path), 1) == 1
    assert h.sync_pread(empty, str(path), 3) == 1
    assert h.async_pread(empty, str(path)) == 0
    assert h.async_pwrite(empty, str(path)) == 0
    assert h.wait() == 2
    assert h.write(empty, str(path), False) == 0
    assert h.read(empty, str(path), False) == 0
    assert path.read_bytes() == b"xyz"


def test_read_exactly_to_eof(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """A read that ends exactly at EOF of an unaligned-size file is allowed and exact."""
    h = aio_module.aio_handle(4096, 4, False, True, 3, engine=engine)
    path = workdir / "e"
    data = os.urandom(3 * 4096 + 17)
    path.write_bytes(data)
    for off in (0, 1, 4096, len(data) - 1):
        dst = torch.zeros(len(data) - off, dtype=torch.uint8)
        assert h.sync_pread(dst, str(path), off) == 1
        assert tbytes(dst) == data[off:]


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_fd_unaligned(aio_module: ModuleType, engine: str, workdir: Path, direct: bool) -> None:
    """Unaligned sizes and offsets work through a caller's descriptor, which stays open and usable."""
    h = aio_module.aio_handle(4096, 4, False, True, 2, engine=engine)
    path = workdir / "fd"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
    try:
        model = bytearray()
        for off, size in ((0, 4097), (1, 511), (5000, 6144), (4096, 8192), (3, 1)):
            data = os.urandom(size)
            src = torch.empty(size + 1, dtype=torch.uint8)[1:]
            fill(src, data)
            assert h.sync_pwrite(src, fd=fd, file_offset=off) == 1
            model.extend(bytes(max(0, off + size - len(model))))
            model[off:off + size] = data
            dst = torch.zeros(size, dtype=torch.uint8)
            assert h.async_pread(dst, fd=fd, file_offset=off) == 0
            assert h.wait() == 1
            assert tbytes(dst) == data
        assert path.read_bytes() == bytes(model)
        assert os.fstat(fd).st_size == len(model)
    finally:
        os.close(fd)


def test_pread_pwrite_accept_fd(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """pread/pwrite take a descriptor in place of the file name, like the sync_/async_ calls."""
    h = aio_module.aio_handle(4096, 4, False, True, 2, engine=engine)
    fd = os.open(workdir / "fd", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        src = torch.arange(100, dtype=torch.uint8)
        assert h.pwrite(src, fd, False, False, 7) == 1
        assert h.pwrite(buffer=src, fd=fd, validate=False, file_offset=107, **{"async": True}) == 0
        assert h.wait() == 1
        dst = torch.zeros(200, dtype=torch.uint8)
        assert h.pread(dst, fd, False, False, 7) == 1
        assert tbytes(dst) == tbytes(src) * 2
        os.fstat(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["plain", "misaligned", "locked"])
def test_concurrent_neighbouring_requests(aio_module: ModuleType, engine: str, workdir: Path,
                                          kind: str) -> None:
    """Async requests on adjacent unaligned regions of one file, in flight at once, never clobber."""
    h = aio_module.aio_handle(4096, 16, False, True, 3, engine=engine)
    path = workdir / "n"
    cuts = [0, 1, 700, 4095, 4097, 9000, 12288, 12289, 20000, 20001, 33333]
    data = os.urandom(cuts[-1])
    path.write_bytes(bytes(len(data)))
    bufs = []
    for a, b in zip(cuts, cuts[1:]):
        t = buffer(h, b - a, kind)
        fill(t, data[a:b])
        bufs.append(t)
        assert h.async_pwrite(t, str(path), a) == 0
    assert h.wait() == len(bufs)
    assert path.read_bytes() == data
    outs = []
    for a, b in zip(cuts, cuts[1:]):
        t = buffer(h, b - a, kind)
        t.fill_(0)
        outs.append(t)
        assert h.async_pread(t, str(path), a) == 0
    assert h.wait() == len(outs)
    assert b"".join(tbytes(t) for t in outs) == data


@pytest.mark.parametrize("qd,block,overlap", [(1, 128 << 10, False), (2, 4096, True), (8, 256 << 10, True),
                                              (32, 3 * MiB, False)])
def test_staged_many_ops_round_trip(engine: str, aio_module: ModuleType, workdir: Path, qd: int, block: int,
                                    overlap: bool) -> None:
    """A misaligned tensor of many staged operations, at depths from 1 up: writes copied ahead of the queue,
    reads copied out after the queue is refilled, blocks below a staging buffer moved a buffer at a time, and
    a tail shorter than a buffer all land every byte where it belongs, in both directions."""
    nbytes = 9 * MiB + 4096 + 17
    h = aio_module.aio_handle(block, qd, False, overlap, 2, engine=engine)
    data = os.urandom(nbytes)
    src = buffer(h, nbytes, "misaligned")
    fill(src, data)
    path = workdir / "many"
    assert h.sync_pwrite(src, str(path)) == 1
    assert path.read_bytes() == data
    dst = buffer(h, nbytes, "misaligned")
    dst.zero_()
    assert h.sync_pread(dst, str(path)) == 1
    assert tbytes(dst) == data
