"""The process-wide registry of locked tensors shared by every aio_handle and pin_handle."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

F32 = torch.empty(0, dtype=torch.float32)


def test_views_of_locked_buffer_are_pinned(aio_module: ModuleType) -> None:
    """A locked tensor and its narrowed, reshaped and dtype views are all pinned."""
    h = aio_module.aio_handle(1024, 2, False, False, 1)
    buf = h.new_cpu_locked_tensor(4096, F32)
    assert h.is_pinned(buf)
    assert h.is_pinned(buf.narrow(0, 1024, 1024))
    assert h.is_pinned(buf[4095:])
    assert h.is_pinned(buf.view(64, 64))
    assert h.is_pinned(buf.view(torch.uint8))
    assert h.free_cpu_locked_tensor(buf) is True


def test_plain_tensors_not_pinned(aio_module: ModuleType) -> None:
    """Ordinary pageable tensors are not pinned, and freeing them is refused with False."""
    h = aio_module.aio_handle()
    plain = torch.empty(4096, dtype=torch.float32)
    assert not h.is_pinned(plain)
    assert h.free_cpu_locked_tensor(plain) is False


def test_free_only_accepts_managed_base(aio_module: ModuleType) -> None:
    """free returns True once for the base of a region, False for an interior view or a second free."""
    h = aio_module.aio_handle()
    buf = h.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8))
    assert h.free_cpu_locked_tensor(buf[4096:]) is False
    assert h.is_pinned(buf)
    assert h.free_cpu_locked_tensor(buf) is True
    assert h.free_cpu_locked_tensor(buf) is False


def test_freed_tensor_memory_stays_valid(aio_module: ModuleType) -> None:
    """After free the tensor still owns its memory until it dies (no dangling pointer)."""
    h = aio_module.aio_handle()
    buf = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    buf.fill_(0x5A)
    view = buf[100:200]
    assert h.free_cpu_locked_tensor(buf) is True
    del buf
    gc.collect()
    junk = [torch.full((1 << 20,), 1, dtype=torch.uint8) for _ in range(8)]
    assert bool((view == 0x5A).all())
    view.fill_(3)
    assert int(view.sum()) == 300
    del junk


def test_shared_across_handles(aio_module: ModuleType, available_engines: list[str]) -> None:
    """A buffer locked through one handle is pinned for every other handle, whatever its engine."""
    handles = [aio_module.aio_handle(1024, 2, False, False, 1, engine=e) for e in available_engines]
    handles.append(aio_module.aio_handle(4096, 8, True, True, 3))
    for owner in handles:
        buf = owner.new_cpu_locked_tensor(4096, F32)
        for other in handles:
            assert other.is_pinned(buf)
            assert other.is_pinned(buf.narrow(0, 10, 100))
        assert handles[-1 if owner is handles[0] else 0].free_cpu_locked_tensor(buf) is True
        for other in handles:
            assert other.free_cpu_locked_tensor(buf) is False


def test_pin_handle_buffer_recognised_by_aio(aio_module: ModuleType, pin_module: ModuleType) -> None:
    """A pin_handle buffer (and its view) is pinned for aio_handle and pin_handle; aio can free it."""
    ph = pin_module.pin_handle()
    h = aio_module.aio_handle()
    buf = ph.new_cpu_locked_tensor(4096, F32)
    assert buf.dtype == torch.float32 and buf.numel() == 4096
    for checker in (ph, h):
        assert checker.is_pinned(buf)
        assert checker.is_pinned(buf.narrow(0, 1024, 1024))
    assert h.free_cpu_locked_tensor(buf) is True
    assert ph.free_cpu_locked_tensor(buf) is False


def test_aio_buffer_recognised_by_pin_handle(aio_module: ModuleType, pin_module: ModuleType) -> None:
    """An aio_handle buffer (and its view) is pinned for pin_handle, which can free it."""
    ph = pin_module.pin_handle()
    h = aio_module.aio_handle()
    buf = h.new_cpu_locked_tensor(4096, F32)
    assert ph.is_pinned(buf)
    assert ph.is_pinned(buf.narrow(0, 1024, 1024))
    assert not ph.is_pinned(torch.empty(16))
    assert ph.free_cpu_locked_tensor(buf) is True
    assert h.free_cpu_locked_tensor(buf) is False


def test_pin_handle_buffer_does_io(aio_module: ModuleType, pin_module: ModuleType, engine: str,
                                   workdir: Path) -> None:
    """A buffer locked by pin_handle is a valid I/O buffer for every engine."""
    ph = pin_module.pin_handle()
    h = aio_module.aio_handle(4096, 4, False, True, 2, engine=engine)
    buf = ph.new_cpu_locked_tensor(65536, torch.empty(0, dtype=torch.uint8))
    data = os.urandom(65536)
    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert h.sync_pwrite(buf, str(workdir / "f")) == 1
    buf.zero_()
    assert h.sync_pread(buf, str(workdir / "f")) == 1
    assert buf.numpy().tobytes() == data
    assert ph.free_cpu_locked_tensor(buf) is True


def test_bad_locked_tensor_requests(aio_module: ModuleType, pin_module: ModuleType) -> None:
    """num_elem <= 0 is a ValueError; a non-tensor example is a TypeError (both handle kinds)."""
    for h in (aio_module.aio_handle(), pin_module.pin_handle()):
        for n in (0, -1):
            with pytest.raises(ValueError):
                h.new_cpu_locked_tensor(n, F32)
        with pytest.raises(TypeError):
            h.new_cpu_locked_tensor(16, "float32")
        with pytest.raises(TypeError):
            h.is_pinned([1, 2, 3])


HUGE = [(2**61, torch.int64), (2**60, torch.int64), (2**62, torch.float32), (2**62, torch.uint8),
        (2**45, torch.uint8)]


@pytest.mark.parametrize("num_elem,dtype", HUGE)
def test_huge_locked_tensor_raises(aio_module: ModuleType, pin_module: ModuleType, num_elem: int,
                                   dtype: torch.dtype) -> None:
    """A size that overflows or cannot be allocated raises; never a tensor over too little memory."""
    for h in (aio_module.aio_handle(), pin_module.pin_handle()):
        with pytest.raises((MemoryError, ValueError, OverflowError, OSError)):
            t = h.new_cpu_locked_tensor(num_elem, torch.empty(0, dtype=dtype))
            pytest.fail(f"got numel {t.numel()} over {t.untyped_storage().nbytes()} bytes")
