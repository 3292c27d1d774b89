"""The op's fresh memory (empty_fresh, settle_fresh, fresh_memory_status; csrc/aio/fresh_memory.h).

A read into it must land the file's bytes with its pages made by the fill itself (no fault, no zeroing), leave
every byte outside the request alone, and stay safe whatever touches the memory first: an early read or write,
a forked child, a read that fails. Real files, real userfaultfd; the page faults are the kernel's own count.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support.vm import vm_flags

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


@pytest.fixture(scope="module")
def fresh_op(aio_module: ModuleType) -> ModuleType:
    status = aio_module.fresh_memory_status()
    if status != "ok":
        pytest.skip(f"userfaultfd unavailable here: {status}")
    return aio_module


@pytest.fixture
def handle(aio_module: ModuleType) -> Any:
    return aio_module.aio_handle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=2)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    data = torch.randint(0, 256, (24 * MIB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    path = tmp_path_factory.mktemp("fresh") / "data.bin"
    data.numpy().tofile(path)
    return path, data


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_the_status_says_ok_or_why_not(aio_module: ModuleType) -> None:
    status = aio_module.fresh_memory_status()
    assert status == "ok" or status.startswith("userfaultfd"), status


@pytest.mark.parametrize(("offset", "nbytes"), [(0, 8 * MIB), (3 * PAGE, 5 * MIB + 7), (PAGE + 100, 2 * MIB),
                                                (0, PAGE), (77, 100)])
def test_a_read_fills_fresh_memory_with_the_files_bytes(fresh_op: ModuleType, handle: Any,
                                                        data_file: tuple[Path, torch.Tensor], offset: int,
                                                        nbytes: int) -> None:
    path, data = data_file
    t = fresh_op.empty_fresh(nbytes, offset % PAGE)
    assert t.numel() == nbytes and t.data_ptr() % PAGE == offset % PAGE
    assert not t.untyped_storage().resizable()
    handle.sync_pread(t, str(path), offset)
    fresh_op.settle_fresh(t)
    assert torch.equal(t, data[offset:offset + nbytes])


def test_the_fill_makes_the_pages_itself_without_faulting_them(fresh_op: ModuleType, handle: Any,
                                                               data_file: tuple[Path, torch.Tensor]) -> None:
    """The point of the memory: its pages are made by UFFDIO_COPY, not by faults that zero them. Memory made
    the usual way, read the same way (staged), takes a fault per page; fresh memory almost none."""
    path, data = data_file
    nbytes, pages = 16 * MIB, 16 * MIB // PAGE
    handle.sync_pread(fresh_op.empty_at_residue(MIB, 64), str(path))  # the staging pool made before counting
    plain = fresh_op.empty_at_residue(nbytes, 64)
    before = minor_faults()
    handle.sync_pread(plain, str(path))
    plain_faults = minor_faults() - before
    fresh = fresh_op.empty_fresh(nbytes, 0)
    before = minor_faults()
    handle.sync_pread(fresh, str(path))
    fresh_faults = minor_faults() - before
    fresh_op.settle_fresh(fresh)
    assert torch.equal(fresh, data[:nbytes]) and torch.equal(plain, data[:nbytes])
    assert plain_faults >= pages // 2, plain_faults
    assert fresh_faults < pages // 16, (fresh_faults, plain_faults)


def test_memory_stays_armed_until_settled_and_settling_twice_is_harmless(fresh_op: ModuleType) -> None:
    t = fresh_op.empty_fresh(4 * MIB, 0)
    assert "um" in vm_flags(t.data_ptr())  # registered with userfaultfd, missing-page mode
    fresh_op.settle_fresh(t)
    assert "um" not in vm_flags(t.data_ptr())
    fresh_op.settle_fresh(t)
    fresh_op.settle_fresh(torch.empty(10, dtype=torch.uint8))  # not fresh memory: nothing to do
    assert int(t.sum()) == 0  # never filled: reads as zero, like any new memory


def test_only_whole_pages_inside_the_tensor_are_armed(fresh_op: ModuleType) -> None:
    """The partial first and last pages are plain memory: deepnvme.load copies them in itself."""
    t = fresh_op.empty_fresh(3 * PAGE, 100)
    assert "um" not in vm_flags(t.data_ptr())  # the first page, shared with nothing but partial
    assert "um" in vm_flags(t.data_ptr() - 100 + PAGE)
    assert "um" not in vm_flags(t.data_ptr() - 100 + 3 * PAGE)
    t[0] = 7
    t[-1] = 9
    fresh_op.settle_fresh(t)
    assert int(t[0]) == 7 and int(t[-1]) == 9 and int(t[1:-1].sum()) == 0


def test_a_read_into_part_of_it_leaves_the_rest_alone(fresh_op: ModuleType, handle: Any,
                                                      data_file: tuple[Path, torch.Tensor]) -> None:
    path, data = data_file
    t = fresh_op.empty_fresh(2 * MIB, 0)
    lo, n = 100, 300_001
    handle.sync_pread(t[lo:lo + n], str(path), 12_345)
    handle.sync_pread(t[MIB:MIB + 4 * PAGE], str(path), 0)
    fresh_op.settle_fresh(t)
    assert torch.equal(t[lo:lo + n], data[12_345:12_345 + n])
    assert torch.equal(t[MIB:MIB + 4 * PAGE], data[:4 * PAGE])
    assert int(t[:lo].sum()) == 0 and int(t[lo + n:MIB].sum()) == 0 and int(t[MIB + 4 * PAGE:].sum()) == 0


def test_a_read_after_settling_goes_the_usual_way(fresh_op: ModuleType, handle: Any,
                                                  data_file: tuple[Path, torch.Tensor]) -> None:
    path, data = data_file
    t = fresh_op.empty_fresh(MIB, 0)
    fresh_op.settle_fresh(t)
    handle.sync_pread(t, str(path), PAGE)
    assert torch.equal(t, data[PAGE:PAGE + MIB])


def test_a_failed_read_raises_and_the_memory_goes(fresh_op: ModuleType, handle: Any,
                                                  data_file: tuple[Path, torch.Tensor]) -> None:
    path, data = data_file
    maps = len(Path("/proc/self/maps").read_text().splitlines())
    t = fresh_op.empty_fresh(2 * MIB, 0)
    with pytest.raises((ValueError, OSError)):
        handle.sync_pread(t, str(path), data.numel() - MIB)  # past the end of the file
    fresh_op.settle_fresh(t)
    del t
    assert len(Path("/proc/self/maps").read_text().splitlines()) <= maps


def test_no_mapping_or_descriptor_is_left_behind(fresh_op: ModuleType, handle: Any,
                                                 data_file: tuple[Path, torch.Tensor]) -> None:
    path, _ = data_file
    fresh_op.empty_fresh(PAGE, 0)  # the process's userfaultfd opened before counting
    fds = len(os.listdir("/proc/self/fd"))
    maps = len(Path("/proc/self/maps").read_text().splitlines())
    for i in range(50):
        t = fresh_op.empty_fresh(MIB + i, i)
        if i % 2:
            handle.sync_pread(t, str(path))
            fresh_op.settle_fresh(t)
        del t
    assert len(os.listdir("/proc/self/fd")) == fds
    assert len(Path("/proc/self/maps").read_text().splitlines()) <= maps


def test_bad_arguments_raise_naming_them(fresh_op: ModuleType) -> None:
    with pytest.raises(ValueError, match="nbytes"):
        fresh_op.empty_fresh(-1, 0)
    with pytest.raises(ValueError, match="residue"):
        fresh_op.empty_fresh(10, PAGE)
    with pytest.raises(ValueError, match="residue"):
        fresh_op.empty_fresh(10, -1)
    with pytest.raises(MemoryError):
        fresh_op.empty_fresh(1 << 62, 0)
    assert fresh_op.empty_fresh(0, 0).numel() == 0


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A Python child with the op loaded; killed (and the test failed) if it hangs."""
    prelude = textwrap.dedent("""
        import os, sys, torch
        torch.set_num_threads(1)
        from deepnvme._core.op import aio_module
        op = aio_module()
        h = op.aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)
        PAGE = os.sysconf("SC_PAGE_SIZE")
    """)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_touching_armed_memory_before_its_read_neither_hangs_nor_changes_the_result(
        fresh_op: ModuleType, data_file: tuple[Path, torch.Tensor]) -> None:
    """An early read sees zero, an early write stays until the read overwrites it: memory as usual."""
    path, _ = data_file
    proc = run_script(f"""
        data = torch.from_file({str(path)!r}, size=4 << 20, dtype=torch.uint8)
        t = op.empty_fresh(4 << 20, 0)
        assert int(t[5 * PAGE + 3]) == 0          # a read of a page not filled yet
        t[9 * PAGE] = 77                          # a write to another
        assert int(t[9 * PAGE]) == 77
        h.sync_pread(t, {str(path)!r})
        op.settle_fresh(t)
        assert torch.equal(t, data), "wrong bytes"
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_forked_child_never_fills_its_parents_memory(fresh_op: ModuleType,
                                                      data_file: tuple[Path, torch.Tensor]) -> None:
    """The child's copy of an armed block is plain memory, its own new blocks are its own: what it reads
    lands in its memory only, and the parent's block is still armed and filled right afterwards."""
    path, _ = data_file
    proc = run_script(f"""
        data = torch.from_file({str(path)!r}, size=8 << 20, dtype=torch.uint8)
        t = op.empty_fresh(4 << 20, 0)
        pid = os.fork()
        if pid == 0:
            try:
                hc = op.aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)
                hc.sync_pread(t, {str(path)!r})
                u = op.empty_fresh(4 << 20, 0)
                hc.sync_pread(u, {str(path)!r}, 4 << 20)
                op.settle_fresh(u)
                ok = torch.equal(t, data[:4 << 20]) and torch.equal(u, data[4 << 20:])
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert int(t.sum()) == 0, "the child's read reached the parent"
        h.sync_pread(t, {str(path)!r}, PAGE)
        op.settle_fresh(t)
        assert torch.equal(t, data[PAGE:PAGE + (4 << 20)])
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
