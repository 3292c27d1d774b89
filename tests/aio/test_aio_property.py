"""Property test: random sequences of reads and writes always agree with a bytearray model of the file."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MiB = 1 << 20
U8 = torch.empty(0, dtype=torch.uint8)

sizes = st.one_of(
    st.integers(0, 3 * MiB),
    st.sampled_from([0, 1, 511, 512, 4095, 4096, 4097, 6144, MiB, MiB + 1]),
    st.integers(0, 9000),
)
offsets = st.one_of(st.integers(0, 2 * MiB), st.sampled_from([0, 1, 512, 4096, 4097]), st.integers(0, 9000))
ops = st.sampled_from(
    ["sync_pwrite", "async_pwrite", "write", "fd_pwrite", "sync_pread", "async_pread", "read"]
)
memory = st.sampled_from(["plain", "misaligned", "locked", "locked_misaligned"])


def make_buffer(h, n: int, kind: str) -> torch.Tensor:
    """A uint8 buffer of n bytes: plain, misaligned by 3 bytes, or a view into a locked tensor."""
    if kind == "locked":
        return h.new_cpu_locked_tensor(n + 4096, U8)[4096 if n % 2 else 0:][:n]
    if kind == "locked_misaligned":
        return h.new_cpu_locked_tensor(n + 1, U8)[1:]
    if kind == "misaligned":
        return torch.empty(n + 3, dtype=torch.uint8)[3:]
    return torch.empty(n, dtype=torch.uint8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_io_matches_model(aio_module: ModuleType, available_engines: list[str],
                                 tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Any mix of engines, P, block sizes, sizes and offsets keeps the file equal to the model."""
    engine = data.draw(st.sampled_from(available_engines), label="engine")
    par = data.draw(st.integers(1, 4), label="P")
    block = data.draw(st.sampled_from([512, 1000, 4096, 65536, MiB]), label="block")
    qd = data.draw(st.sampled_from([1, 2, 8, 32]), label="qd")
    single = data.draw(st.booleans(), label="single_submit")
    overlap = data.draw(st.booleans(), label="overlap")
    h = aio_module.aio_handle(block, qd, single, overlap, par, engine=engine)
    path: Path = tmp_path_factory.mktemp("prop") / "f"
    path.write_bytes(b"")
    model = bytearray()
    pending: list[tuple[torch.Tensor, bytes]] = []

    def drain() -> None:
        assert h.wait() == len(pending)
        for buf, expect in pending:
            assert buf.numpy().tobytes() == expect
        pending.clear()

    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        op = data.draw(ops, label="op")
        size, off = data.draw(sizes, label="size"), data.draw(offsets, label="offset")
        if op.endswith("pread") or op == "read":
            if model and data.draw(st.integers(0, 3), label="in_bounds") > 0:
                off = data.draw(st.integers(0, len(model)), label="read_offset")
                size = data.draw(st.integers(0, len(model) - off), label="read_size")
        buf = make_buffer(h, size, data.draw(memory, label="memory"))
        if op != "async_pread":
            drain()
        if op.endswith("pwrite") or op == "write":
            payload = os.urandom(size)
            if size:
                buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            if op == "sync_pwrite":
                assert h.sync_pwrite(buf, str(path), off) == 1
            elif op == "write":
                assert h.write(buf, str(path), False, off) == 0
            elif op == "fd_pwrite":
                direct = data.draw(st.booleans(), label="O_DIRECT")
                fd = os.open(path, os.O_WRONLY | (os.O_DIRECT if direct else 0))
                try:
                    assert h.sync_pwrite(buf, fd=fd, file_offset=off) == 1
                finally:
                    os.close(fd)
            else:
                assert h.async_pwrite(buf, str(path), off) == 0
                assert h.wait() == 1
            if size:
                model.extend(bytes(max(0, off + size - len(model))))
                model[off:off + size] = payload
        else:
            if size and off + size > len(model):  # an empty read never goes past the end
                with pytest.raises(ValueError):
                    h.sync_pread(buf, str(path), off)
                continue
            if op == "sync_pread":
                assert h.sync_pread(buf, str(path), off) == 1
            elif op == "read":
                assert h.read(buf, str(path), False, off) == 0
            else:
                assert h.async_pread(buf, str(path), off) == 0
                pending.append((buf, bytes(model[off:off + size])))
                continue
            assert buf.numpy().tobytes() == bytes(model[off:off + size])
        assert path.read_bytes() == bytes(model)
    drain()
    assert h.wait() == 0
    assert path.read_bytes() == bytes(model)
