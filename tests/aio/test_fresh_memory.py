"""The op's fresh memory (empty_fresh, settle_fresh, fresh_memory_status; csrc/aio/fresh_memory.h).

A read into it must land the file's bytes with its pages made by the fill itself (no fault, no zeroing), leave
every byte outside the request alone, and stay safe whatever touches the memory first: an early read or write,
a forked child, a read that fails. Real files, real userfaultfd; the page faults are the kernel's own count.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support.vm import faults, vm_flags

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
# Leak checks count this process's mappings over many blocks rather than demanding no change at all: the
# allocator (ASan's above all) maps regions of its own at moments no test controls, while a leak repeats
# once per block and so stands far above that noise.
LEAK_ROUNDS = 24


def _mapping_count() -> int:
    return len(Path("/proc/self/maps").read_text().splitlines())


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


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


def resident(address: int, pages: int) -> list[bool]:
    """Whether each of the `pages` pages from page-aligned `address` is present (mincore(2))."""
    vec = ctypes.create_string_buffer(pages)
    if _libc.mincore(ctypes.c_void_p(address), pages * PAGE, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return [bool(b & 1) for b in vec.raw]


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
    """The point of the memory: its pages are made by UFFDIO_COPY, not by faults that zero them. A new
    mapping of plain memory, read the same way (staged), takes a fault per page; fresh memory almost none."""
    path, data = data_file
    nbytes, pages = 16 * MIB, 16 * MIB // PAGE
    handle.sync_pread(fresh_op.empty_at_residue(MIB, 64), str(path))  # the staging pool made before counting
    # A mapping of its own, small pages: allocator memory may be pages an earlier test already faulted.
    region = mmap.mmap(-1, nbytes + PAGE)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    plain = torch.frombuffer(region, dtype=torch.uint8)[64:64 + nbytes]
    before = faults()
    handle.sync_pread(plain, str(path))
    plain_faults = faults() - before
    fresh = fresh_op.empty_fresh(nbytes, 0)
    before = faults()
    handle.sync_pread(fresh, str(path))
    fresh_faults = faults() - before
    fresh_op.settle_fresh(fresh)
    assert torch.equal(fresh, data[:nbytes]) and torch.equal(plain, data[:nbytes])
    assert plain_faults >= pages // 2, plain_faults
    assert fresh_faults < pages // 16, (fresh_faults, plain_faults)


def test_memory_stays_armed_until_settled_and_settling_twice_is_harmless(fresh_op: ModuleType) -> None:
    t = fresh_op.empty_fresh(4 * MIB, 0)
    assert "um" in vm_flags(t.data_ptr() + PAGE)  # registered with userfaultfd, missing-page mode
    fresh_op.settle_fresh(t)
    assert "um" not in vm_flags(t.data_ptr() + PAGE)
    fresh_op.settle_fresh(t)
    fresh_op.settle_fresh(torch.empty(10, dtype=torch.uint8))  # not fresh memory: nothing to do
    assert int(t.sum()) == 0  # never filled: reads as zero, like any new memory


def test_the_partial_first_and_last_pages_are_made_at_once(fresh_op: ModuleType) -> None:
    """The whole mapping is armed, but its partial pages, which only the caller writes (deepnvme.load copies
    the payload's edges in itself), are present from the start: writing them faults nothing."""
    t = fresh_op.empty_fresh(3 * PAGE, 100)
    assert "um" in vm_flags(t.data_ptr()) and "um" in vm_flags(t.data_ptr() + 3 * PAGE - 1)
    assert resident(t.data_ptr() - 100, 4) == [True, False, False, True]
    t[0] = 7
    t[-1] = 9
    fresh_op.settle_fresh(t)
    assert int(t[0]) == 7 and int(t[-1]) == 9 and int(t[1:-1].sum()) == 0


def test_neighbouring_blocks_share_mappings(fresh_op: ModuleType) -> None:
    """Thousands of small payloads (a checkpoint of many tensors, at torch.save's 64-byte residues) must not
    take a mapping or two each: vm.max_map_count (65530 by default) would end the process."""
    maps = len(Path("/proc/self/maps").read_text().splitlines())
    blocks = [fresh_op.empty_fresh(64 << 10, 100) for _ in range(3000)]
    grown = len(Path("/proc/self/maps").read_text().splitlines()) - maps
    assert all("um" in vm_flags(b.data_ptr() + PAGE) for b in blocks[::500])
    for b in blocks:
        fresh_op.settle_fresh(b)
    settled = len(Path("/proc/self/maps").read_text().splitlines()) - maps
    assert grown < 300 and settled < 300, (grown, settled)


def test_a_write_from_partly_filled_armed_memory_writes_its_bytes(fresh_op: ModuleType, handle: Any,
                                                                  data_file: tuple[Path, torch.Tensor],
                                                                  tmp_path: Path) -> None:
    """Unfilled pages read as zero; the handle reads the memory from user space (staged), never through the
    kernel, so this holds with a user-mode-only userfaultfd too."""
    path, data = data_file
    t = fresh_op.empty_fresh(MIB, 0)
    handle.sync_pread(t[:MIB // 2], str(path))
    want = torch.cat([data[:MIB // 2], torch.zeros(MIB // 2, dtype=torch.uint8)])
    for validate in (False, True):
        out = tmp_path / f"w{validate}.bin"
        handle.pwrite(t, str(out), validate, False)  # DeepSpeed's (buffer, filename, validate, async)
        assert torch.equal(torch.from_file(str(out), size=MIB, dtype=torch.uint8), want)
    fresh_op.settle_fresh(t)


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
    maps = _mapping_count()
    for _ in range(LEAK_ROUNDS):
        t = fresh_op.empty_fresh(2 * MIB, 0)
        with pytest.raises((ValueError, OSError)):
            handle.sync_pread(t, str(path), data.numel() - MIB)  # past the end of the file
        fresh_op.settle_fresh(t)
        del t
    assert _mapping_count() - maps < LEAK_ROUNDS // 2


def test_no_mapping_or_descriptor_is_left_behind(fresh_op: ModuleType, handle: Any,
                                                 data_file: tuple[Path, torch.Tensor]) -> None:
    path, _ = data_file
    fresh_op.empty_fresh(PAGE, 0)  # the process's userfaultfd opened before counting
    fds = len(os.listdir("/proc/self/fd"))
    maps = _mapping_count()
    for i in range(2 * LEAK_ROUNDS):
        t = fresh_op.empty_fresh(MIB + i, i)
        if i % 2:
            handle.sync_pread(t, str(path))
            fresh_op.settle_fresh(t)
        del t
    assert len(os.listdir("/proc/self/fd")) == fds
    assert _mapping_count() - maps < LEAK_ROUNDS // 2


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


def run_script(body: str, timeout: float = 60, env: dict[str, str] | None = None,
               wrap: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """A Python child with the op loaded (`env` added to its environment, its command line after `wrap`);
    killed (and the test failed) if it hangs."""
    prelude = textwrap.dedent("""
        import os, sys, torch
        torch.set_num_threads(1)
        from deepnvme._core.op import aio_module
        op = aio_module()
        h = op.aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)
        PAGE = os.sysconf("SC_PAGE_SIZE")
    """)
    root = Path(__file__).resolve().parents[2]
    full = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
    return subprocess.run([*(wrap or []), sys.executable, "-c", prelude + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=timeout, env=full)


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
        def uffds():
            found = []
            for n in os.listdir("/proc/self/fd"):
                try:
                    if "userfaultfd" in os.readlink(f"/proc/self/fd/{{n}}"):
                        found.append(n)
                except OSError:  # listdir's own descriptor, closed by now
                    pass
            return found
        assert len(uffds()) == 1
        pid = os.fork()
        if pid == 0:
            try:
                if uffds():  # the parent's descriptor, closed at the fork
                    os._exit(5)
                hc = op.aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)
                hc.sync_pread(t, {str(path)!r})
                if uffds():  # the parent's block is plain memory here: no descriptor needed to learn that
                    os._exit(7)
                mine = os.open({str(path)!r}, os.O_RDONLY)  # may take the number the descriptor had
                op.fresh_memory_status()
                if os.readlink(f"/proc/self/fd/{{mine}}") != {str(path)!r}:
                    os._exit(6)
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


# Helpers for the child scripts below: this process's userfaultfds; read a file into fresh tensors and check.
UFFDS = textwrap.dedent("""
    def uffds():
        found = []
        for n in os.listdir("/proc/self/fd"):
            try:
                if "userfaultfd" in os.readlink(f"/proc/self/fd/{n}"):
                    found.append(int(n))
            except OSError:  # listdir's own descriptor, closed by now
                pass
        return found

    def read_and_check(path, *tensors):
        data = torch.from_file(path, size=tensors[0].numel(), dtype=torch.uint8)
        for x in tensors:
            h.sync_pread(x, path)
            op.settle_fresh(x)
            assert torch.equal(x, data)
""")


def test_running_out_of_descriptors_only_delays_fresh_filling(data_file: tuple[Path, torch.Tensor]) -> None:
    """With no descriptor to spare the userfaultfd cannot be opened (EMFILE); once descriptors are free again
    the next block opens it: a passing shortage does not end fresh filling for the rest of the process, as a
    refusal (no permission, no kernel support) does."""
    path, _ = data_file
    proc = run_script(UFFDS + textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        # Only the status while no descriptor is free: a sanitizer's own checks need descriptors too.
        status = op.fresh_memory_status()
        os.close(held.pop())  # one for listing the descriptors
        assert "Too many open files" in status and not uffds(), status
        for fd in held:
            os.close(fd)
        t = op.empty_fresh(1 << 20, 0)
        assert op.fresh_memory_status() == "ok" and len(uffds()) == 1, op.fresh_memory_status()
        read_and_check({str(path)!r}, t)
        print("ok")
    """))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_descriptor_closed_by_other_code_ends_fresh_filling_quietly(
        data_file: tuple[Path, torch.Tensor]) -> None:
    """Code that closes descriptors it does not own (a sweep of /proc/self/fd) may close the userfaultfd, and
    the next file opened takes its number: an early touch of armed memory still reads zero without hanging,
    the thread that served the descriptor stops instead of spinning or reading that file, the status says
    what happened, and reads into new memory, armed before or after the close, get the file's bytes."""
    path, _ = data_file
    proc = run_script(UFFDS + textwrap.dedent(f"""
        import time
        before = op.empty_fresh(1 << 20, 0)
        assert op.fresh_memory_status() == "ok"
        (fd,) = uffds()
        os.close(fd)
        victim = os.open({str(path)!r}, os.O_RDONLY)  # usually takes the number: the server must not read it
        # The sleeping server holds the file open until a fault wakes it: touch an armed page.
        assert int(before[5 * PAGE]) == 0
        time.sleep(0.2)
        cpu = time.process_time()
        time.sleep(0.5)
        spent = time.process_time() - cpu
        assert spent < 0.15, f"{{spent:.2f}} CPU-seconds in half a second of sleep"
        assert os.lseek(victim, 0, os.SEEK_CUR) == 0, "the server read the file that took its number"
        assert "closed by other code" in op.fresh_memory_status(), op.fresh_memory_status()
        read_and_check({str(path)!r}, before, op.empty_fresh(1 << 20, 0))
        print("ok")
    """))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("taker", ["file", "userfaultfd"])
def test_a_descriptor_closed_and_reused_while_nothing_faults_is_noticed(
        data_file: tuple[Path, torch.Tensor], taker: str) -> None:
    """The userfaultfd closed by other code and its number taken by another file, or by another userfaultfd
    (another library's), while no fault wakes the server: the next block notices, the status says so, new
    blocks are plain memory filled right (an early touch does not wait for an answer from the other
    userfaultfd), and the file that took the number is left alone."""
    path, _ = data_file
    proc = run_script(UFFDS + textwrap.dedent(f"""
        import ctypes, fcntl, struct
        assert op.fresh_memory_status() == "ok"
        (fd,) = uffds()
        os.close(fd)
        if {taker!r} == "file":
            victim = os.open({str(path)!r}, os.O_RDONLY)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            victim = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK)  # userfaultfd(2) on x86-64
            fcntl.ioctl(victim, 0xC018AA3F, struct.pack("QQQ", 0xAA, 0, 0))  # UFFDIO_API
        assert victim == fd, (victim, fd)
        t = op.empty_fresh(1 << 20, 0)
        assert int(t[3 * PAGE]) == 0  # an early touch: answered by the kernel, the block is plain
        read_and_check({str(path)!r}, t)
        assert "closed by other code" in op.fresh_memory_status(), op.fresh_memory_status()
        if {taker!r} == "file":
            assert os.lseek(victim, 0, os.SEEK_CUR) == 0
        print("ok")
    """), timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_thread_that_serves_faults_takes_no_signals() -> None:
    """Process-directed signals (Ctrl-C, a profiler's timer) go to a thread that can act on them: the one
    that answers faults blocks them all."""
    proc = run_script("""
        import signal
        def tasks():
            return set(os.listdir("/proc/self/task"))
        old = tasks()
        assert op.fresh_memory_status() == "ok"
        (server,) = tasks() - old
        status = open(f"/proc/self/task/{server}/status").read()
        blocked = int(next(l for l in status.splitlines() if l.startswith("SigBlk:")).split()[1], 16)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPROF, signal.SIGALRM, signal.SIGUSR1):
            assert blocked & (1 << (sig - 1)), (sig, hex(blocked))
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_switch_turns_fresh_filling_off(data_file: tuple[Path, torch.Tensor]) -> None:
    """DEEPNVME_FILL_FRESH=0: no userfaultfd is opened (for a seccomp filter that would kill the process);
    the memory is plain and reads into it are right."""
    path, _ = data_file
    proc = run_script(f"""
        assert op.fresh_memory_status() == "turned off (DEEPNVME_FILL_FRESH=0)", op.fresh_memory_status()
        data = torch.from_file({str(path)!r}, size=1 << 20, dtype=torch.uint8)
        t = op.empty_fresh(1 << 20, 0)
        h.sync_pread(t, {str(path)!r})
        assert torch.equal(t, data)
        fds = [f"/proc/self/fd/{{n}}" for n in os.listdir("/proc/self/fd")]
        assert not any("userfaultfd" in os.readlink(f) for f in fds if os.path.exists(f))
        print("ok")
    """, env={"DEEPNVME_FILL_FRESH": "0"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_without_the_ptrace_capability_user_mode_faults_only_still_work(
        fresh_op: ModuleType, data_file: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    """Most users may not handle kernel-mode faults (vm.unprivileged_userfaultfd=0 and no CAP_SYS_PTRACE):
    their userfaultfd is user-mode only, and any read the kernel did into armed memory would fail with EFAULT.
    As such a process: reads into fresh memory (whole, partial, unaligned), an early touch, a write from
    partly filled memory, and deepnvme.load of a torch.save file filled fresh."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_SYS_PTRACE")
    path, _ = data_file
    ckpt = tmp_path / "c.pt"
    torch.save({"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(70_000)}, ckpt)
    proc = run_script(f"""
        from pathlib import Path
        import errno
        caps = [l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("CapEff:")]
        assert not int(caps[0].split()[1], 16) & (1 << 19), caps  # CAP_SYS_PTRACE is bit 19
        assert op.fresh_memory_status() == "ok"
        u = op.empty_fresh(1 << 20, 0)  # the mode itself: the kernel may not fault armed pages in
        fd = os.open({str(path)!r}, os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(u.numpy())], 0)
            raise SystemExit("a kernel read into armed memory went through: not user-mode only")
        except OSError as e:
            assert e.errno == errno.EFAULT, e
        os.close(fd)
        data = torch.from_file({str(path)!r}, size=8 << 20, dtype=torch.uint8)
        t = op.empty_fresh(4 << 20, 100)
        assert int(t[3 * PAGE]) == 0
        h.sync_pread(t[:2 << 20], {str(path)!r}, 100)
        h.sync_pread(t[(2 << 20) + 7:], {str(path)!r}, (2 << 20) + 107)
        h.sync_pwrite(t, {str(tmp_path / "out.bin")!r})
        op.settle_fresh(t)
        assert torch.equal(t[:2 << 20], data[100:(2 << 20) + 100])
        assert torch.equal(t[(2 << 20) + 7:], data[(2 << 20) + 107:(4 << 20) + 100])
        import deepnvme
        from deepnvme import serialization
        assert serialization.FILL_FRESH
        got = deepnvme.load({str(ckpt)!r})
        assert torch.equal(got["a"], torch.arange(300_000, dtype=torch.float32))
        assert torch.equal(got["b"], torch.ones(70_000))
        print("ok")
    """, wrap=["setpriv", "--bounding-set", "-sys_ptrace", "--inh-caps", "-sys_ptrace", "--"])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
