"""gds_handle on a CUDA machine: DeepSpeed's gds test matrix, unaligned sizes and offsets, pinning, threads,
the GIL, the host path, and the error cases (each an exception, never a dead process)."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

BLOCK_SIZE = 256 * 1024
QUEUE_DEPTH = 2
IO_SIZE = 1024 * 1024
IO_PARALLEL = 2


def _handle(gds: ModuleType, single_submit: bool = False, overlap_events: bool = False,
            parallel: int = IO_PARALLEL, block_size: int = BLOCK_SIZE) -> Any:
    h = gds.gds_handle(block_size, QUEUE_DEPTH, single_submit, overlap_events, parallel)
    assert h.get_block_size() == block_size
    assert h.get_queue_depth() == QUEUE_DEPTH
    assert h.get_single_submit() == single_submit
    assert h.get_overlap_events() == overlap_events
    assert h.get_intra_op_parallelism() == parallel
    return h


def _payload(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def _device_bytes(data: bytes) -> Any:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()


def _as_bytes(t: Any) -> bytes:
    return t.cpu().numpy().tobytes()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    d = tmp_path / "gds"
    d.mkdir()
    return d


# ------------------------------------------------------------------------------------- DeepSpeed's matrix
@pytest.mark.parametrize("single_submit", [True, False])
@pytest.mark.parametrize("overlap_events", [True, False])
@pytest.mark.parametrize("use_async", [False, True])
def test_read(gds_module: ModuleType, work: Path, single_submit: bool, overlap_events: bool,
              use_async: bool) -> None:
    data = _payload(IO_SIZE)
    f = work / "in.bin"
    f.write_bytes(data)
    h = _handle(gds_module, single_submit, overlap_events)
    buf = torch.empty(IO_SIZE, dtype=torch.uint8, device="cuda")
    assert h.pin_device_tensor(buf)
    if use_async:
        assert h.async_pread(buf, str(f), 0) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pread(buf, str(f), 0) == 1
    assert _as_bytes(buf) == data
    assert h.unpin_device_tensor(buf)


@pytest.mark.parametrize("single_submit", [True, False])
@pytest.mark.parametrize("overlap_events", [True, False])
@pytest.mark.parametrize("use_async", [False, True])
def test_write(gds_module: ModuleType, work: Path, single_submit: bool, overlap_events: bool,
               use_async: bool) -> None:
    data = _payload(IO_SIZE, 1)
    f = work / "out.bin"
    h = _handle(gds_module, single_submit, overlap_events)
    buf = _device_bytes(data)
    assert h.pin_device_tensor(buf)
    if use_async:
        assert h.async_pwrite(buf, str(f), 0) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pwrite(buf, str(f), 0) == 1
    assert f.read_bytes() == data
    assert h.unpin_device_tensor(buf)


@pytest.mark.parametrize("n", [2, 3])
def test_async_queue(gds_module: ModuleType, work: Path, n: int) -> None:
    h = _handle(gds_module, True, True)
    payloads = [_payload(IO_SIZE, 10 + i) for i in range(n)]
    srcs = [_device_bytes(p) for p in payloads]
    for i, t in enumerate(srcs):
        assert h.async_pwrite(t, str(work / f"q{i}.bin")) == 0
    assert h.wait() == n
    for i, p in enumerate(payloads):
        assert (work / f"q{i}.bin").read_bytes() == p
    dsts = [torch.empty(IO_SIZE, dtype=torch.uint8, device="cuda") for _ in range(n)]
    for i, t in enumerate(dsts):
        assert h.async_pread(t, str(work / f"q{i}.bin")) == 0
    assert h.wait() == n
    assert [_as_bytes(t) for t in dsts] == payloads
    assert h.wait() == 0


@pytest.mark.parametrize("use_new_api", [True, False])
def test_pin_device_tensor(gds_module: ModuleType, use_new_api: bool) -> None:
    h = _handle(gds_module)
    example = torch.empty(1000, dtype=torch.float16, device="cuda")
    if use_new_api:
        t = h.new_pinned_device_tensor(example.numel(), example)
    else:
        t = torch.empty_like(example)
        assert h.pin_device_tensor(t)
    assert t.device == example.device and t.dtype == example.dtype and t.numel() == example.numel()
    assert h.is_pinned(t) and h.is_pinned(t[10:20])
    with pytest.raises(ValueError, match="already pinned"):
        h.pin_device_tensor(t)
    if use_new_api:
        assert h.free_pinned_device_tensor(t)
    else:
        assert h.unpin_device_tensor(t)
    assert not h.is_pinned(t)
    assert not h.unpin_device_tensor(t)  # not pinned any more: False, not a crash


def test_new_pinned_tensor_deregisters_when_it_dies(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module)
    t = h.new_pinned_device_tensor(IO_SIZE, torch.empty(0, dtype=torch.uint8, device="cuda"))
    ptr = t.data_ptr()
    del t
    u = torch.empty(IO_SIZE, dtype=torch.uint8, device="cuda")  # the caching allocator may hand back ptr
    if u.data_ptr() == ptr:
        assert not h.is_pinned(u)
    assert h.pin_device_tensor(u) and h.unpin_device_tensor(u)


@pytest.mark.parametrize("use_fd", [False, True])
@pytest.mark.parametrize("parts", [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]])
def test_offset_write(gds_module: ModuleType, work: Path, parts: list[int], use_fd: bool) -> None:
    unit = IO_SIZE
    h = _handle(gds_module, True, True)
    data = _payload(sum(parts) * unit, 20)
    src = h.new_pinned_device_tensor(len(data), torch.empty(0, dtype=torch.uint8, device="cuda"))
    src.copy_(_device_bytes(data))
    ref, out = work / "ref.bin", work / "out.bin"
    fd = os.open(out, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0)) if use_fd else -1
    try:
        off = 0
        for p in parts:
            n = p * unit
            with ref.open("ab") as r:
                r.write(data[off:off + n])
            piece = src.narrow(0, off, n)  # a CUDA view inside a pinned region: base + offset for cuFile
            if use_fd:
                assert h.async_pwrite(buffer=piece, fd=fd, file_offset=off) == 0
            else:
                assert h.async_pwrite(buffer=piece, filename=str(out), file_offset=off) == 0
            assert h.wait() == 1
            off += n
            assert out.read_bytes() == ref.read_bytes()
    finally:
        if fd >= 0:
            os.close(fd)
    assert h.free_pinned_device_tensor(src)


@pytest.mark.parametrize("parts", [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]])
def test_offset_read(gds_module: ModuleType, work: Path, parts: list[int]) -> None:
    unit = 256 * 1024
    h = _handle(gds_module, True, True)
    data = _payload(sum(parts) * unit, 21)
    f = work / "in.bin"
    f.write_bytes(data)
    buf = torch.empty(len(data), dtype=torch.uint8, device="cuda")
    h.pin_device_tensor(buf)
    off = 0
    for p in parts:
        n = p * unit
        assert h.async_pread(buf.narrow(0, off, n), str(f), off) == 0
        assert h.wait() == 1
        assert _as_bytes(buf.narrow(0, off, n)) == data[off:off + n]
        off += n
    assert h.unpin_device_tensor(buf)


# ------------------------------------------------------------------------------- beyond DeepSpeed's tests
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("parallel", [1, 3])
@pytest.mark.parametrize("size,offset", [(1, 0), (511, 1), (4097, 4095), (IO_SIZE + 3, 0),
                                         (3 * IO_SIZE + 123, 4096 + 7), (8 * IO_SIZE, 512)])
def test_unaligned_round_trip(gds_module: ModuleType, work: Path, size: int, offset: int, parallel: int,
                              pinned: bool) -> None:
    h = _handle(gds_module, parallel=parallel)
    data = _payload(size, size)
    f = work / "rt.bin"
    f.write_bytes(b"\xee" * offset)
    src = _device_bytes(data)
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    if pinned:
        h.pin_device_tensor(src)
        h.pin_device_tensor(dst)
    assert h.sync_pwrite(src, str(f), offset) == 1
    assert f.read_bytes() == b"\xee" * offset + data
    assert h.sync_pread(dst, str(f), offset) == 1
    assert _as_bytes(dst) == data
    assert h.pread(dst, str(f), True, False, offset) == 1  # validate: device memory == file
    if pinned:
        assert h.unpin_device_tensor(src) and h.unpin_device_tensor(dst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_dtypes_and_views(gds_module: ModuleType, work: Path, dtype: Any) -> None:
    h = _handle(gds_module)
    src = torch.arange(300_001, device="cuda").to(dtype)
    f = work / "t.bin"
    assert h.sync_pwrite(src, str(f)) == 1
    dst = torch.empty(300_001 + 5, dtype=dtype, device="cuda")
    assert h.sync_pread(dst[5:], str(f)) == 1  # a view that starts mid-allocation, unregistered
    assert torch.equal(dst[5:], src)


def test_cpu_tensors_take_the_host_path(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module)
    data = _payload(IO_SIZE + 17, 30)
    locked = h.new_cpu_locked_tensor(len(data), torch.empty(0, dtype=torch.uint8))
    locked.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert h.is_pinned(locked)
    f = work / "cpu.bin"
    assert h.sync_pwrite(locked, str(f)) == 1
    plain = torch.zeros(len(data), dtype=torch.uint8)
    assert h.async_pread(plain, str(f)) == 0
    dev = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
    assert h.async_pread(dev, str(f)) == 0
    assert h.wait() == 2  # one wait() covers the host side and the cuFile side
    assert plain.numpy().tobytes() == data and _as_bytes(dev) == data
    assert h.free_cpu_locked_tensor(locked)


def test_pinned_in_one_handle_used_by_another(gds_module: ModuleType, work: Path) -> None:
    a, b = _handle(gds_module), _handle(gds_module, parallel=4)
    data = _payload(2 * IO_SIZE, 31)
    t = a.new_pinned_device_tensor(len(data), torch.empty(0, dtype=torch.uint8, device="cuda"))
    t.copy_(_device_bytes(data))
    assert b.is_pinned(t)
    assert b.sync_pwrite(t, str(work / "x.bin")) == 1
    assert (work / "x.bin").read_bytes() == data


def test_io_mode_is_reported(gds_module: ModuleType) -> None:
    h = _handle(gds_module)
    mode = h.get_io_mode()
    assert mode in ("gpudirect", "compat")
    assert h.is_gpudirect() == (mode == "gpudirect")
    info = h.get_io_info()
    assert info["mode"] == mode and isinstance(info["notes"], list)
    print(f"\ncuFile session: {info}")


def test_nothing_written_to_the_working_directory(gds_module: ModuleType, work: Path,
                                                  monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    h = _handle(gds_module)
    buf = _device_bytes(_payload(IO_SIZE, 32))
    assert h.sync_pwrite(buf, str(work / "w.bin")) == 1
    with pytest.raises(FileNotFoundError):
        h.sync_pread(buf, str(work / "missing.bin"))
    assert list(cwd.iterdir()) == []  # no local_cufile.json, no cufile.log


def test_intra_op_parallelism_is_real(gds_module: ModuleType, work: Path) -> None:
    before = len(os.listdir("/proc/self/task"))
    h = _handle(gds_module, parallel=6)
    assert len(os.listdir("/proc/self/task")) - before >= 6  # cuFile worker threads (plus the host engine's)
    data = _payload(6 * IO_SIZE, 33)
    assert h.sync_pwrite(_device_bytes(data), str(work / "p.bin")) == 1
    assert (work / "p.bin").read_bytes() == data


def test_blocking_calls_release_the_gil(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module, parallel=1)
    size = 64 * IO_SIZE
    buf = torch.zeros(size, dtype=torch.uint8, device="cuda")
    f = work / "gil.bin"
    assert h.sync_pwrite(buf, str(f)) == 1
    ran = threading.Event()
    go = threading.Lock()
    go.acquire()

    def peer() -> None:
        with go:
            ran.set()

    t = threading.Thread(target=peer)
    t.start()
    old = sys.getswitchinterval()
    sys.setswitchinterval(60)  # the interpreter will not switch on its own: only a GIL release lets peer run
    try:
        go.release()
        # Reads until the peer has run, not a fixed count that a busy machine may finish before the peer is
        # scheduled; the limit, well inside the 60 s switch interval, only ends a call that keeps the GIL.
        give_up = time.monotonic() + 20
        while not ran.is_set() and time.monotonic() < give_up:
            assert h.sync_pread(buf, str(f)) == 1
        during = ran.is_set()  # before join(), which itself lets the peer run
    finally:
        sys.setswitchinterval(old)
    t.join(30)
    assert during, "the peer never ran during a read: sync_pread keeps the GIL"


def test_concurrent_callers_on_one_handle(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module)
    data = _payload(4 * IO_SIZE, 34)
    (work / "c.bin").write_bytes(data)
    bufs = [torch.zeros(len(data), dtype=torch.uint8, device="cuda") for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def reader(b: Any) -> None:
        try:
            barrier.wait()
            for _ in range(8):
                assert h.sync_pread(b, str(work / "c.bin")) >= 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(b,)) for b in bufs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(_as_bytes(b) == data for b in bufs)


def test_pending_cuda_read_holds_its_storage(gds_module: ModuleType, work: Path) -> None:
    """The shared request pipeline holds a CUDA buffer as it holds a host one: until wait() hands the request
    back its storage cannot be resized (torch raises RuntimeError), then it can again."""
    h = _handle(gds_module)
    data = _payload(IO_SIZE, 35)
    (work / "hold.bin").write_bytes(data)
    buf = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
    assert h.async_pread(buf, str(work / "hold.bin")) == 0
    with pytest.raises(RuntimeError, match="resiz"):
        buf.untyped_storage().resize_(0)
    assert h.wait() == 1
    assert _as_bytes(buf) == data
    buf.untyped_storage().resize_(len(data))  # handed back: resizable again


def test_inherited_handle_refuses_work_in_a_forked_child(gds_module: ModuleType, work: Path) -> None:
    """A gds_handle made before fork() has no threads in the child: it refuses work with RuntimeError naming
    fork, and its destructor leaves the parent's threads alone (the child exits normally). The child touches
    no CUDA: a host tensor goes through the same pipeline check."""
    h = _handle(gds_module)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            h.sync_pwrite(torch.zeros(16, dtype=torch.uint8), str(work / "never.bin"))
        except RuntimeError as e:
            code = 0 if "fork" in str(e) else 2
        except BaseException:  # noqa: BLE001 - any other outcome is reported through the exit code
            code = 4
        del h
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (work / "never.bin").exists()
    t = _device_bytes(_payload(4096, 36))
    assert h.sync_pwrite(t, str(work / "after.bin")) == 1  # the parent's handle is untouched


def test_write_after_kernel_sees_the_kernel_result(gds_module: ModuleType, work: Path) -> None:
    """cuFile is not stream-ordered: the handle must wait for the kernels that produce the buffer."""
    h = _handle(gds_module)
    x = torch.zeros(16 * IO_SIZE // 4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued on torch's current stream...
    x.add_(7)  # ...before the kernel that produces the data
    assert h.sync_pwrite(x, str(work / "k.bin")) == 1
    assert (work / "k.bin").read_bytes() == torch.full_like(x, 7).cpu().numpy().tobytes()


def test_tmpfs_file_works_one_way_or_another(gds_module: ModuleType) -> None:
    """cuFile may refuse a file system (tmpfs has no O_DIRECT): the handle then stages, with a warning."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    h = _handle(gds_module)
    data = _payload(IO_SIZE + 5, 35)
    f = shm / f"deepnvme-gds-{os.getpid()}.bin"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert h.sync_pwrite(_device_bytes(data), str(f)) == 1
            dst = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
            assert h.sync_pread(dst, str(f)) == 1
        assert f.read_bytes() == data and _as_bytes(dst) == data
        print(f"\ntmpfs: staged_requests={h.get_io_info()['staged_requests']}")
    finally:
        f.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------- errors
def test_missing_file_raises_with_its_name(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module)
    buf = torch.empty(IO_SIZE, dtype=torch.uint8, device="cuda")
    missing = work / "nope.bin"
    with pytest.raises(FileNotFoundError) as e:
        h.sync_pread(buf, str(missing))
    assert e.value.filename == str(missing)
    with pytest.raises(FileNotFoundError):
        h.sync_pwrite(buf, str(work / "no_dir" / "x.bin"))
    assert h.wait() == 0  # nothing left behind


def test_read_past_end_is_a_value_error(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module)
    f = work / "short.bin"
    f.write_bytes(b"x" * 1000)
    with pytest.raises(ValueError, match="past end of file"):
        h.sync_pread(torch.empty(4096, dtype=torch.uint8, device="cuda"), str(f))
    with pytest.raises(ValueError):
        h.async_pread(torch.empty(1000, dtype=torch.uint8, device="cuda"), str(f), 1)


def test_directory_is_an_os_error(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module)
    with pytest.raises(IsADirectoryError):
        h.sync_pread(torch.empty(16, dtype=torch.uint8, device="cuda"), str(work))


def test_bad_arguments_are_value_errors(gds_module: ModuleType, work: Path) -> None:
    h = _handle(gds_module)
    dev = torch.empty(64, 64, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(dev.t(), str(work / "a.bin"))
    with pytest.raises(ValueError, match="file_offset"):
        h.sync_pwrite(dev, str(work / "a.bin"), -1)
    with pytest.raises(ValueError, match="CUDA tensor"):
        h.pin_device_tensor(torch.empty(16))
    with pytest.raises(ValueError):
        h.new_pinned_device_tensor(0, dev)
    with pytest.raises(ValueError):
        gds_module.gds_handle(1024, 2, False, False, 0)
    with pytest.raises(ValueError):
        h.sync_pread(dev, -3)
    t = torch.empty(IO_SIZE, dtype=torch.uint8, device="cuda")
    h.pin_device_tensor(t[: IO_SIZE // 2])
    try:
        with pytest.raises(ValueError, match="past its end"):  # starts in a pinned region, ends outside
            h.sync_pwrite(t[IO_SIZE // 4:], str(work / "b.bin"))
        with pytest.raises(ValueError, match="overlaps"):
            h.pin_device_tensor(t[IO_SIZE // 4:])
    finally:
        assert h.unpin_device_tensor(t[: IO_SIZE // 2])

