"""GIL release, handles shared by threads, destruction with requests in flight, fd and locked-memory leaks."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from builder_helpers import REPO_ROOT
from proc_stats import fd_count, vm_lck_kb
from thread_helpers import run_threads, wait_until

MiB = 1 << 20
U8 = torch.empty(0, dtype=torch.uint8)


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(n: int) -> tuple[torch.Tensor, bytes]:
    """A plain uint8 tensor holding n random bytes, and the bytes."""
    data = os.urandom(n)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), data


# ----------------------------------------------------------------------------- GIL

@pytest.mark.parametrize("op", ["sync_pread", "sync_pwrite", "pread", "pwrite", "read", "write", "wait"])
def test_blocking_call_releases_gil(aio_module: ModuleType, workdir: Path, op: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With a 60 s switch interval, a peer thread still runs during a blocking call: the GIL is released.
    Decided by events, not by a race with the transfer: the fault engine holds the call's first block until
    the peer, which needs the GIL, sees it held and opens its gate. A call that kept the GIL would wait for
    the gate until the hold gives up (ETIMEDOUT) and fail. (Releasing the GIL is the binding's, the same for
    every engine.)"""
    size = 8 * MiB
    gate = workdir / "gate"
    gate.mkdir()
    monkeypatch.setenv("DEEPNVME_FAULT", "hold@1")
    monkeypatch.setenv("DEEPNVME_FAULT_GATE", str(gate))
    h = aio_module.aio_handle(MiB, 8, False, True, 2, engine="fault")
    buf = h.new_cpu_locked_tensor(size, U8)
    path = workdir / "gil"
    payload, data = random_tensor(size)
    buf.copy_(payload)
    path.write_bytes(data)
    calls: dict[str, Callable[[], object]] = {
        "sync_pread": lambda: h.sync_pread(buf, str(path)),
        "sync_pwrite": lambda: h.sync_pwrite(buf, str(path)),
        "pread": lambda: h.pread(buf, str(path), False, False),
        "pwrite": lambda: h.pwrite(buf, str(path), False, False),
        "read": lambda: h.read(buf, str(path), False),
        "write": lambda: h.write(buf, str(path), False),
        "wait": h.wait,
    }
    expected = 0 if op in ("read", "write") else 1
    ran = threading.Event()

    def peer() -> None:
        # Only once the block is held (the call is under way) may it finish: a peer that ran before the
        # call, as it may while being started, would prove nothing.
        wait_until(lambda: (gate / "held.1").exists(), "the call's first block held")
        ran.set()
        (gate / "go.1").touch()

    old = sys.getswitchinterval()
    sys.setswitchinterval(60)
    try:
        t = threading.Thread(target=peer, daemon=True)
        t.start()
        if op == "wait":
            assert h.async_pread(buf, str(path)) == 0
        assert calls[op]() == expected
    finally:
        sys.setswitchinterval(old)
    t.join(60)
    assert ran.is_set()
    assert h.sync_pread(buf, str(path)) == 1
    assert tbytes(buf) == data


def test_threads_share_one_handle(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Four threads doing sync writes and reads through one handle each get 1 and their own bytes back."""
    h = aio_module.aio_handle(65536, 16, False, True, 2, engine=engine)

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            path = str(workdir / f"t{k}")
            for i in range(12):
                size = 4096 * (k + 1) + 333 * i
                src, data = random_tensor(size)
                assert h.sync_pwrite(src, path, i) == 1
                dst = torch.zeros(size, dtype=torch.uint8) if i % 2 else h.new_cpu_locked_tensor(size, U8)
                assert h.sync_pread(dst, path, i) == 1
                assert tbytes(dst) == data
                if not i % 2:
                    assert h.free_cpu_locked_tensor(dst) is True
        return run

    run_threads([worker(k) for k in range(4)])
    assert h.wait() == 0


def test_locked_alloc_while_reading(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Allocating and freeing locked tensors in one thread while another reads plain buffers is safe."""
    h = aio_module.aio_handle(4096, 2, True, True, 2, engine=engine)
    path = str(workdir / "r")
    _, data = random_tensor(4096)
    Path(path).write_bytes(data)
    dst = torch.zeros(4096, dtype=torch.uint8)

    def reader() -> None:
        for _ in range(32):
            assert h.sync_pread(dst, path) == 1

    def locker() -> None:
        for _ in range(32):
            t = h.new_cpu_locked_tensor(4096, U8)
            assert h.free_cpu_locked_tensor(t) is True

    run_threads([reader, locker])
    assert tbytes(dst) == data


def test_threads_read_by_shared_and_reused_descriptors(aio_module: ModuleType, engine: str,
                                                      workdir: Path) -> None:
    """Two threads queue reads by one shared descriptor while two others open their own files, queue reads by
    them and close them at once (so descriptor numbers pass from file to file between threads): every read
    gets the bytes of the file its descriptor held when it was submitted."""
    h = aio_module.aio_handle(4096, 8, False, True, 2, engine=engine)
    blocks = 8
    contents = {}
    for k in range(3):
        _, contents[k] = random_tensor(blocks * 4096)
        (workdir / f"f{k}").write_bytes(contents[k])
    shared = os.open(workdir / "f0", os.O_RDONLY)
    queued: list[tuple[torch.Tensor, bytes]] = []

    def sharer() -> None:
        for i in range(48):
            at = i % blocks * 4096
            buf = torch.zeros(4096, dtype=torch.uint8)
            h.async_pread(buf, shared, at)
            queued.append((buf, contents[0][at:at + 4096]))

    def churner(k: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(48):
                at = i % blocks * 4096
                buf = torch.zeros(4096, dtype=torch.uint8)
                fd = os.open(workdir / f"f{k}", os.O_RDONLY)
                try:
                    h.async_pread(buf, fd, at)
                finally:
                    os.close(fd)
                queued.append((buf, contents[k][at:at + 4096]))
        return run

    try:
        run_threads([sharer, sharer, churner(1), churner(2)])
        assert h.wait() == 4 * 48
    finally:
        os.close(shared)
    assert all(tbytes(buf) == want for buf, want in queued)


# ----------------------------------------------------------------------------- signals

def _task_field(tid: str, name: str) -> str:
    """A line's value in /proc/self/task/<tid>/status ("" once the thread has gone)."""
    try:
        status = Path(f"/proc/self/task/{tid}/status").read_text()
    except OSError:
        return ""
    values = (line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith(f"{name}:"))
    return next(values, "")


def test_worker_threads_take_no_asynchronous_signals(aio_module: ModuleType, engine: str) -> None:
    """A process-directed signal (Ctrl-C, setitimer's SIGALRM, a profiler's SIGPROF) never lands on a handle's
    worker threads: they start with every asynchronous signal blocked (the creating thread's mask is as it
    was), so one that can act on it takes it. Pending on a thread that submits to io_uring, a signal made the
    kernel fail to start the io-wq helper a punted request needed, and the request completed with ECANCELED
    (test_swap's signal test, on a busy machine). Faults (SIGSEGV, SIGBUS...) stay open to reach handlers."""
    tasks = Path("/proc/self/task")
    main_tid = str(threading.get_native_id())
    mask_before = _task_field(main_tid, "SigBlk")
    before = set(os.listdir(tasks))
    h = aio_module.aio_handle(65536, 4, False, True, 3, engine=engine)
    new = set(os.listdir(tasks)) - before

    assert len(new) == 3, new
    # A thread still in glibc's start runs with every signal blocked: wait until each sleeps for work.
    wait_until(lambda: all(_task_field(t, "State")[:1] in ("S", "D") for t in new), "the workers to wait")
    for tid in new:
        blocked = int(_task_field(tid, "SigBlk"), 16)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGPROF, signal.SIGUSR1,
                    signal.SIGCHLD, signal.SIGPIPE):
            assert blocked & (1 << (sig - 1)), (tid, sig, hex(blocked))
        for sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL):
            assert not blocked & (1 << (sig - 1)), (tid, sig, hex(blocked))
        assert _task_field(tid, "Name") == "dnv-aio-worker"
    assert _task_field(main_tid, "SigBlk") == mask_before
    del h


def test_requests_complete_under_a_storm_of_signals(aio_module: ModuleType, engine: str,
                                                    workdir: Path) -> None:
    """SIGALRM every 0.1 ms, handled by Python, while fresh handles read a file just written (O_DIRECT over
    dirty pages: io_uring hands those reads to io-wq helpers the submitting thread must start) and write new
    ones: every request completes with its bytes, none with EINTR or ECANCELED. (With the worker threads
    taking signals, io_uring's requests failed here with ECANCELED in about 3 runs of 4.)"""
    size, n = 16384, 8
    src, data = random_tensor(size * n)
    calls = 0

    def on_alarm(_signum: int, _frame: object) -> None:
        nonlocal calls
        calls += 1

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.0001, 0.0001)
    try:
        for i in range(16):
            path = workdir / f"s{i}"
            path.write_bytes(data)
            h = aio_module.aio_handle(size, 4, False, True, 4, engine=engine)
            bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
            ids = [h.submit_pread(b, str(path), k * size) for k, b in enumerate(bufs)]
            ids += [h.submit_pwrite(src[k * size:(k + 1) * size], str(workdir / f"w{i}"), k * size)
                    for k in range(n)]
            assert [h.wait_request(rid) for rid in ids] == [size] * (2 * n)
            assert b"".join(tbytes(b) for b in bufs) == data
            assert (workdir / f"w{i}").read_bytes() == data
            del h
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert calls > 0


# ----------------------------------------------------------------------------- destruction

@pytest.mark.parametrize("kind", ["write", "read"])
def test_destroy_with_pending_requests(aio_module: ModuleType, engine: str, workdir: Path, kind: str) -> None:
    """Deleting a handle right after many async requests waits for them; every file/buffer is complete."""
    n, size = 48, 256 * 1024 + 7
    h = aio_module.aio_handle(65536, 4, False, False, 2, engine=engine)
    items = [random_tensor(size) for _ in range(n)]
    bufs = []
    for i, (src, data) in enumerate(items):
        path = str(workdir / f"d{i}")
        if kind == "write":
            assert h.async_pwrite(src, path) == 0
        else:
            Path(path).write_bytes(data)
            dst = torch.zeros(size, dtype=torch.uint8)
            bufs.append(dst)
            assert h.async_pread(dst, path) == 0
    del h
    gc.collect()
    for i, (_, data) in enumerate(items):
        if kind == "write":
            assert (workdir / f"d{i}").read_bytes() == data, i
        else:
            assert tbytes(bufs[i]) == data, i


def test_pending_request_keeps_buffer_alive(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Dropping the last reference to a buffer with a request in flight neither crashes nor corrupts."""
    h = aio_module.aio_handle(65536, 4, False, True, 2, engine=engine)
    expected = []
    for i in range(16):
        src, data = random_tensor(300_000 + i)
        expected.append(data)
        assert h.async_pwrite(src, str(workdir / f"k{i}"), 0) == 0
        del src
    gc.collect()
    junk = [torch.full((300_000,), 0xAB, dtype=torch.uint8) for _ in range(16)]
    assert h.wait() == 16
    for i, data in enumerate(expected):
        assert (workdir / f"k{i}").read_bytes() == data, i
    for i in range(16):
        assert h.async_pread(torch.empty(300_000 + i, dtype=torch.uint8), str(workdir / f"k{i}")) == 0
    gc.collect()
    assert h.wait() == 16
    del junk


def test_destroy_with_failed_pending_request(aio_module: ModuleType, workdir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a handle whose pending request failed neither crashes nor loses the other requests."""
    monkeypatch.setenv("DEEPNVME_FAULT", "eio@2")
    h = aio_module.aio_handle(4096, 4, False, False, 1, engine="fault")
    items = [random_tensor(4 * 4096) for _ in range(4)]
    for i, (src, _) in enumerate(items):
        assert h.async_pwrite(src, str(workdir / f"e{i}")) == 0
    del h
    gc.collect()
    intact = sum((workdir / f"e{i}").read_bytes() == data for i, (_, data) in enumerate(items))
    assert intact >= 3


EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch
    from op_builder import AsyncIOBuilder
    m = AsyncIOBuilder().load()
    d = sys.argv[1]
    H = m.aio_handle(1 << 20, 8, False, True, 2)  # a module global, destroyed during interpreter shutdown
    for i in range(24):
        assert H.async_pwrite(torch.full((1 << 20,), i, dtype=torch.uint8), f"{d}/f{i}") == 0
    L = H.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    L.fill_(99)
    assert H.async_pwrite(L, f"{d}/locked") == 0
    raise SystemExit(3)
""")


def test_interpreter_exit_with_pending_requests(workdir: Path) -> None:
    """Exiting Python with async requests in flight on a global handle finishes them, without a crash."""
    script = workdir / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    r = subprocess.run([sys.executable, str(script), str(workdir)], check=False, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    for i in range(24):
        assert (workdir / f"f{i}").read_bytes() == bytes([i]) * MiB, i
    assert (workdir / "locked").read_bytes() == bytes([99]) * MiB


# ----------------------------------------------------------------------------- leaks

def test_no_fd_leak(aio_module: ModuleType, available_engines: list[str], workdir: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of operations, failed ones included, leave the process's descriptor count unchanged."""
    gc.collect()
    baseline = fd_count()
    path = str(workdir / "f")
    src, _ = random_tensor(10000)
    dst = torch.empty(10000, dtype=torch.uint8)
    monkeypatch.setenv("DEEPNVME_FAULT", "eio@1")
    fault = aio_module.aio_handle(4096, 4, False, False, 1, engine="fault")
    handles = [aio_module.aio_handle(4096, 4, False, True, 2, engine=e) for e in available_engines]
    with_handles = None
    for rnd in range(30):
        for h in handles:
            assert h.sync_pwrite(src, path) == 1
            assert h.sync_pread(src, path) == 1
            assert h.async_pwrite(src, path, 5) == 0
            assert h.async_pread(dst, path) == 0  # not src: reading into it while it is written out races
            assert h.wait() == 2
            assert h.write(src, path, True) == 0
            assert h.read(src, path, True) == 0
            with pytest.raises(FileNotFoundError):
                h.sync_pread(src, path + ".missing")
            with pytest.raises(ValueError):
                h.sync_pread(torch.zeros(20000, dtype=torch.uint8), path)
            with pytest.raises(NotADirectoryError):
                h.sync_pwrite(src, path + "/x")
            with pytest.raises(IsADirectoryError):
                h.sync_pwrite(src, str(workdir))
        fault_h = aio_module.aio_handle(4096, 4, False, False, 1, engine="fault")
        with pytest.raises(OSError) as e:
            fault_h.sync_pwrite(src, path)
        assert e.value.errno == errno.EIO
        del fault_h
        if rnd == 4:
            gc.collect()
            with_handles = fd_count()
    gc.collect()
    assert fd_count() == with_handles, "descriptors leak per operation"
    del handles, fault
    gc.collect()
    assert fd_count() == baseline, "descriptors leak per handle"


def test_no_locked_memory_leak(aio_module: ModuleType, pin_module: ModuleType, available_engines: list[str],
                               workdir: Path) -> None:
    """VmLck returns to its baseline after locked tensors are freed and handles (with their pools) die."""
    gc.collect()
    baseline = vm_lck_kb()
    ph = pin_module.pin_handle()
    handles = [aio_module.aio_handle(MiB, 8, False, True, 2, engine=e) for e in available_engines]
    locked = [h.new_cpu_locked_tensor(MiB, U8) for h in handles] + [ph.new_cpu_locked_tensor(MiB, U8)]
    assert vm_lck_kb() >= baseline + len(locked) * 1024, "new_cpu_locked_tensor did not lock memory"
    path = str(workdir / "f")
    for h in handles:
        plain, data = random_tensor(3 * MiB + 1)
        misaligned = torch.empty(3 * MiB + 2, dtype=torch.uint8)[1:]
        assert h.sync_pwrite(plain, path, 1) == 1
        assert h.sync_pread(misaligned, path, 1) == 1
        assert tbytes(misaligned) == data
    for t in locked:
        assert handles[0].free_cpu_locked_tensor(t) is True
    del locked, t, handles, h, ph
    gc.collect()
    assert vm_lck_kb() == baseline


MLOCK_SCRIPT = textwrap.dedent("""
    import os, sys, warnings, torch
    from op_builder import AsyncIOBuilder
    m = AsyncIOBuilder().load()
    path = sys.argv[1]
    n = 64 << 20
    for engine in m.available_engines():
        h = m.aio_handle(1 << 20, 8, False, True, 2, engine=engine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
            except (MemoryError, OSError) as e:
                print("raised", type(e).__name__, file=sys.stderr)
                buf = torch.empty(n, dtype=torch.uint8)
            else:
                warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
                assert warned, [str(w.message) for w in caught]
                assert buf.numel() == n and h.is_pinned(buf), "fallback tensor must stay managed"
        data = torch.randint(0, 256, (n,), dtype=torch.uint8)
        buf.copy_(data)
        assert h.sync_pwrite(buf, path) == 1
        buf.zero_()
        assert h.sync_pread(buf, path) == 1
        assert torch.equal(buf, data)
        plain = torch.empty(n + 1, dtype=torch.uint8)[1:]
        assert h.sync_pread(plain, path) == 1 and torch.equal(plain, data)
        if h.is_pinned(buf):
            assert h.free_cpu_locked_tensor(buf) is True
    print("OK")
""")


def test_mlock_failure_is_not_fatal(aio_module: ModuleType, workdir: Path) -> None:
    """Without CAP_IPC_LOCK and a 64 KiB RLIMIT_MEMLOCK, a 64 MiB locked tensor warns or raises; I/O works."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop CAP_IPC_LOCK")
    script = workdir / "mlock.py"
    script.write_text(MLOCK_SCRIPT)
    cmd = f"prlimit --memlock=65536 {sys.executable} {script} {workdir / 'data'}"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    r = subprocess.run(["capsh", "--drop=cap_ipc_lock", "--", "-c", cmd], check=False, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip().endswith("OK"), r.stdout
