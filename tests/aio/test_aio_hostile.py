"""A hostile user against one handle: files that change size under a read, tensors whose storage is resized
or swapped, descriptors closed after submission, pipes, fork(), Ctrl-C, odd paths and views, huge blocks and
warnings turned into errors. Whatever can crash or hang runs in a child process with a time limit."""

from __future__ import annotations

import errno
import os
import socket
import textwrap
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from child import run_in_child
from mounts import mounted

KiB, MiB = 1 << 10, 1 << 20
U8 = torch.empty(0, dtype=torch.uint8)

PRELUDE = textwrap.dedent("""
    import errno, os, signal, sys, threading, time
    import torch
    from op_builder import AsyncIOBuilder
    m = AsyncIOBuilder().load()
    from tests.support.forks import reap_child
    from tests.support.thread_helpers import wait_until
    U8 = torch.empty(0, dtype=torch.uint8)
    d = sys.argv[1]

    def wait_for_file(path, limit=60):
        # An event another thread or the fault engine announces by creating a file (see hold@N).
        wait_until(lambda: os.path.exists(path), path, limit)
""")


def run_child(workdir: Path, body: str, timeout: float = 120) -> str:
    """Run PRELUDE + body in a fresh interpreter; fail on a crash, a hang or a non-zero exit; give stdout."""
    return run_in_child(workdir, PRELUDE + textwrap.dedent(body), timeout)


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor."""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


# ----------------------------------------------------------------------------- files that change under a read

def test_file_rewritten_during_read(workdir: Path) -> None:
    """A file cut to an unaligned length inside its last block and written back at once, over and over, while
    it is read, on every engine, for locked and plain (staged) tensors: each read raises OSError(EIO) or (cut
    when submitted) ValueError, or succeeds with the file's bytes, exact up to the lowest cut; memory around
    the buffer stays untouched; nothing crashes or hangs.

    Past the lowest cut a successful read may hold zeros, which Linux puts there, not the handle: a read
    through the page cache that saw the size before a truncation may copy the zeros the truncation left on
    the rest of the new end's page or folio (no read is atomic against truncate), and a short O_DIRECT read
    leaves zeros past the new end in its buffer. The second also means that here a lost remainder looks
    like the first, so where a short, unaligned O_DIRECT read's remainder goes (the bug this test was
    written for) is checked exactly by test_aio_fault.py::test_unaligned_short_remainder_is_buffered."""
    out = run_child(workdir, """
        import random
        size = 1 << 20
        tail = 65536  # every cut falls in the file's last `tail` bytes
        data = os.urandom(size)
        path = f"{d}/moving"
        with open(path, "wb") as f:
            f.write(data)
        stop = threading.Event()

        def rewriter():
            fd = os.open(path, os.O_WRONLY)
            rnd = random.Random(1)
            while not stop.is_set():
                cut = size - rnd.randrange(1, tail) | 1  # never a multiple of a sector
                os.ftruncate(fd, cut)
                os.pwrite(fd, data[cut:], cut)
                time.sleep(0.0002)
            os.close(fd)

        t = threading.Thread(target=rewriter, daemon=True)
        t.start()
        ref = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        seen = {}
        # Six seconds of reads, and on until one has succeeded: on a busy machine the rewriter may win more
        # races, and the test wants both outcomes, not a fixed number of rounds.
        deadline, give_up = time.monotonic() + 6, time.monotonic() + 120
        while time.monotonic() < deadline or ("ok" not in seen and time.monotonic() < give_up):
            for engine in m.available_engines():
                h = m.aio_handle(64 << 10, 8, False, True, 1, engine=engine)
                locked = h.new_cpu_locked_tensor(size, U8)
                guarded = torch.full((size + 8192,), 0xA5, dtype=torch.uint8)
                for kind, buf in (("locked", locked), ("plain", guarded[4097:4097 + size])):
                    for _ in range(20):
                        buf.fill_(0x5A)
                        try:
                            h.sync_pread(buf, path)
                        except OSError as e:
                            assert e.errno == errno.EIO and e.filename == path, e
                            result = "eio"
                        except ValueError as e:
                            assert "past end of file" in str(e), e
                            result = "cut at submit"
                        else:
                            wrong = (buf != ref).nonzero().flatten()
                            result = "ok" if wrong.numel() == 0 else "zeros of a racing truncate"
                            assert wrong.numel() == 0 or (int(wrong[0]) >= size - tail
                                                          and bool((buf[wrong] == 0).all())), (
                                f"{engine} {kind}: a successful read, wrong bytes at {wrong[:8].tolist()}")
                        seen[result] = seen.get(result, 0) + 1
                        outside = torch.cat([guarded[:4097], guarded[4097 + size:]])
                        assert bool((outside == 0xA5).all()), f"{engine}: wrote outside the buffer"
                h.free_cpu_locked_tensor(locked)
        stop.set()
        t.join()
        print(seen)
    """, timeout=240)  # room for the 120 s the child may go on for a success, and its start
    assert "'ok'" in out, out


# ---------------------------------------------------------------------------- tensors changed under requests

def test_storage_resize_refused_and_swap_kept_alive(workdir: Path) -> None:
    """While a request is pending its storage cannot be resized (torch raises RuntimeError), a swapped storage
    (set_, .data =) stays alive for the request, and wait() says the read went to the old storage; afterwards
    the storage is resizable again and the handle works."""
    run_child(workdir, """
        n = 32 << 20
        data = os.urandom(n)
        path = f"{d}/big"
        with open(path, "wb") as f:
            f.write(data)
        ref = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for engine in m.available_engines():
            h = m.aio_handle(64 << 10, 2, True, False, 1, engine=engine)
            for kind in ("resize", "resize_tensor", "set_", "data"):
                t = torch.empty(n + 1, dtype=torch.uint8)[1:]  # plain and misaligned: staged, the slow path
                assert h.async_pread(t, path) == 0
                if kind == "resize":
                    try:
                        t.untyped_storage().resize_(0)
                    except RuntimeError as e:
                        assert "resiz" in str(e), e
                    else:
                        raise AssertionError("resize_ of a pending request's storage was allowed")
                elif kind == "resize_tensor":
                    try:
                        t.resize_(4 * n)
                    except RuntimeError:
                        pass
                    else:
                        raise AssertionError("growing a pending request's tensor was allowed")
                elif kind == "set_":
                    t.set_(torch.empty(10, dtype=torch.uint8))
                else:
                    t.data = torch.empty(10, dtype=torch.uint8)
                junk = [torch.full((1 << 20,), 7, dtype=torch.uint8) for _ in range(40)]
                try:
                    h.wait()
                except RuntimeError as e:
                    assert kind in ("set_", "data") and "memory it had before" in str(e), (kind, e)
                else:
                    assert kind.startswith("resize"), f"{kind}: a read into a swapped storage succeeded"
                    assert torch.equal(t[:n], ref), kind
                del junk
            t = torch.empty(4096, dtype=torch.uint8)
            assert h.sync_pread(t, path) == 1
            t.untyped_storage().resize_(8192)  # resizable again once nothing is pending
            src = torch.full((n,), 3, dtype=torch.uint8)
            assert h.async_pwrite(src, f"{d}/w-{engine}") == 0
            src.set_(torch.empty(0, dtype=torch.uint8))  # the write keeps and writes the old storage
            assert h.wait() == 1
            with open(f"{d}/w-{engine}", "rb") as f:
                assert f.read() == bytes([3]) * n
        print("ok")
    """)


def test_interpreter_exit_with_a_daemon_thread_inside_wait_ends_quietly(workdir: Path) -> None:
    """The interpreter exits while a daemon thread submits reads and waits for them: CPython ends that thread
    as it takes the GIL back, and the process exits normally (it aborted in std::terminate when the GIL was
    taken back in a destructor). Three exits, at whatever point the thread is."""
    for _ in range(3):
        out = run_child(workdir, """
            n = 8 << 20
            path = f"{d}/data"
            with open(path, "wb") as f:
                f.write(os.urandom(n))
            t = torch.empty(n, dtype=torch.uint8)
            h = m.aio_handle(1 << 16, 8, False, False, 1)

            def loop():
                while True:
                    h.async_pread(t, path)
                    h.wait()

            threading.Thread(target=loop, daemon=True).start()
            time.sleep(0.5)
            print("exiting")
        """)
        assert out.strip() == "exiting"


# ----------------------------------------------------------------------------- descriptors

def test_fd_closed_after_submit_is_safe(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """A descriptor closed right after async_pwrite, its number reused for another file: the data lands in the
    file the descriptor named at submission, and the other file is untouched."""
    h = aio_module.aio_handle(64 * KiB, 4, False, False, 1, engine=engine)
    first = torch.full((16 * MiB,), 1, dtype=torch.uint8)
    assert h.async_pwrite(first, str(workdir / "first")) == 0  # keeps the worker busy
    src = torch.full((MiB,), 9, dtype=torch.uint8)
    target, decoy = workdir / "target", workdir / "decoy"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
    assert h.async_pwrite(src, fd, 0) == 0
    os.close(fd)
    fd2 = os.open(decoy, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert fd2 == fd, "the number was not reused; the test proves nothing"
        assert h.wait() == 2
    finally:
        os.close(fd2)
    assert target.read_bytes() == bytes([9]) * MiB
    assert decoy.read_bytes() == b""


def test_non_positional_fds_refused(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Pipes, sockets, terminals and FIFOs (by path, without blocking in open) are refused with ESPIPE."""
    h = aio_module.aio_handle(4096, 4, False, False, 1, engine=engine)
    buf = torch.zeros(4096, dtype=torch.uint8)
    r, w = os.pipe()
    a, b = socket.socketpair()
    master, slave = os.openpty()
    try:
        for fd in (r, w, a.fileno(), slave):
            for call in (h.sync_pwrite, h.sync_pread, h.async_pwrite, h.async_pread):
                with pytest.raises(OSError) as e:
                    call(buf, fd, 4096)
                assert e.value.errno == errno.ESPIPE, (fd, call)
    finally:
        for fd in (r, w, master, slave):
            os.close(fd)
        a.close()
        b.close()
    fifo = workdir / "fifo"
    os.mkfifo(fifo)
    for call in (h.sync_pread, h.sync_pwrite):
        raised: list[BaseException] = []

        def attempt(call=call, raised=raised) -> None:
            try:
                call(buf, str(fifo))
            except BaseException as e:  # noqa: BLE001 - checked below
                raised.append(e)

        t = threading.Thread(target=attempt, daemon=True)  # a blocking open() must fail the test, not hang it
        t.start()
        t.join(30)
        assert not t.is_alive(), "open() of a FIFO blocked"
        assert isinstance(raised[0], OSError) and raised[0].errno == errno.ESPIPE, raised
        assert raised[0].filename == str(fifo)
    assert h.wait() == 0


# ----------------------------------------------------------------------------- fork

def test_fork_child_with_idle_and_busy_handles(workdir: Path) -> None:
    """fork() while the parent's staged I/O is in flight: the child refuses the inherited handles with a clear
    error, makes new handles with the inherited module (staged I/O included), and exits normally; the parent's
    requests complete intact."""
    out = run_child(workdir, """
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded, use of fork() may deadlock"
        n = 64 << 20
        idle = m.aio_handle(1 << 20, 8, False, True, 2)
        busy = m.aio_handle(64 << 10, 8, False, True, 2)
        srcs = [torch.full((n + 1,), i, dtype=torch.uint8)[1:] for i in range(3)]  # misaligned: staged
        for i, s in enumerate(srcs):
            assert busy.async_pwrite(s, f"{d}/p{i}") == 0
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)  # torch's OpenMP pool is not fork-safe (libgomp): not ours to test
            try:
                busy.sync_pwrite(torch.zeros(10, dtype=torch.uint8), f"{d}/never")
            except RuntimeError as e:
                assert "fork" in str(e), e
            else:
                raise AssertionError("an inherited handle did I/O without its threads")
            for engine in m.available_engines():
                h = m.aio_handle(64 << 10, 8, False, True, 2, engine=engine)
                t = torch.arange(3 << 20, dtype=torch.uint8)[5:]  # misaligned: staged
                assert h.sync_pwrite(t, f"{d}/c-{engine}") == 1
                back = torch.empty_like(t)
                assert h.sync_pread(back, f"{d}/c-{engine}") == 1
                assert torch.equal(back, t)
            sys.exit(0)  # a normal exit: the inherited handles are destroyed at interpreter shutdown
        assert reap_child(pid, 60) == 0
        assert busy.wait() == 3
        for i in range(3):
            with open(f"{d}/p{i}", "rb") as f:
                assert f.read() == bytes([i]) * n, i
        print("ok")
    """)
    assert out.strip() == "ok"


# ----------------------------------------------------------------------------- Ctrl-C

def test_ctrl_c_interrupts_sync_call_and_wait(workdir: Path) -> None:
    """SIGINT during a sync read/write or wait() raises KeyboardInterrupt while the transfer cannot finish:
    the fault engine holds its first block until the SIGINT handler opens the gate, so nothing races a timer.
    The interrupted call returns once that block finished, hands its cancelled request back, and the handle
    stays usable with correct data. (The interruption is the request pipeline's, the same for every engine;
    only the fault engine can hold a block.)"""
    out = run_child(workdir, """
        n = 16 << 20
        path = f"{d}/sparse"
        with open(path, "wb") as f:
            f.truncate(n)
        gate = ""

        def on_sigint(signum, frame):
            open(f"{gate}/go.1", "w").close()  # the held block may finish now: the call is being interrupted
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)
        for what in ("sync_pread", "wait", "sync_pwrite"):
            for attempt in range(20):
                gate = f"{d}/gate-{what}-{attempt}"
                os.mkdir(gate)
                os.environ.update(DEEPNVME_FAULT="hold@1", DEEPNVME_FAULT_GATE=gate)
                h = m.aio_handle(1 << 20, 4, False, True, 1, engine="fault")
                buf = h.new_cpu_locked_tensor(n, U8)
                interrupter = threading.Thread(target=lambda: (wait_for_file(f"{gate}/held.1"),
                                                               os.kill(os.getpid(), signal.SIGINT)))
                interrupter.start()
                try:
                    if what == "sync_pread":
                        h.sync_pread(buf, path)
                    elif what == "sync_pwrite":
                        h.sync_pwrite(buf, f"{d}/out")
                    else:
                        h.async_pread(buf, path)
                        h.wait()
                except KeyboardInterrupt:
                    pass
                else:
                    raise AssertionError(f"{what}: returned while its first block was held")
                interrupter.join()
                # The interrupted call handed its request back; only a SIGINT that landed between
                # async_pread and wait() leaves the read pending: then wait() was not tested, go again.
                left = h.wait()
                if left == 0 or what != "wait":
                    break
                h.free_cpu_locked_tensor(buf)
            else:
                raise AssertionError("SIGINT never landed inside wait()")
            assert left == 0, (what, left)
            print(what, "attempts", attempt + 1)
            small = torch.arange(100000, dtype=torch.int32)
            assert h.sync_pwrite(small, f"{d}/after") == 1
            back = torch.empty_like(small)
            assert h.sync_pread(back, f"{d}/after") == 1
            assert torch.equal(back, small)
            h.free_cpu_locked_tensor(buf)
        print("ok")
    """, timeout=120)
    assert out.strip().endswith("ok"), out


def test_ctrl_c_hands_back_requests_reported_by_another_thread(workdir: Path) -> None:
    """A sync call covers the pending async requests too; when another thread's wait() reports one of them and
    the tensor is dropped, the interrupted call holds its last reference. That reference must go with the GIL
    held and the handle's lock free: the tensor's finalizer here enqueues a request on the same handle, which
    hung (or crashed) when the reference went down with the Ctrl-C path's local list.

    Ordered by events, not timers: the fault engine holds the async write's block (1) and the sync read's
    first block (2); a SIGUSR1 handler, which can run only in the sync call's signal poll once block 2 is
    held, proves the call is waiting (so it covers the write); then the write is released and reported by
    the other thread, and SIGINT (whose handler releases block 2) interrupts the read."""
    out = run_child(workdir, """
        import weakref
        n = 4 << 20
        path = f"{d}/sparse"
        with open(path, "wb") as f:
            f.truncate(n)
        gate = f"{d}/gate"
        os.mkdir(gate)
        os.environ.update(DEEPNVME_FAULT="hold@1,hold@2", DEEPNVME_FAULT_GATE=gate)
        h = m.aio_handle(64 << 10, 4, False, True, 2, engine="fault")
        buf = h.new_cpu_locked_tensor(n, U8)
        polled = threading.Event()

        def on_sigusr1(signum, frame):
            polled.set()

        def on_sigint(signum, frame):
            open(f"{gate}/go.2", "w").close()
            raise KeyboardInterrupt

        signal.signal(signal.SIGUSR1, on_sigusr1)
        signal.signal(signal.SIGINT, on_sigint)
        small = torch.arange(1024, dtype=torch.int32)
        assert h.async_pwrite(small, f"{d}/a") == 0
        wait_for_file(f"{gate}/held.1")  # block 1 is the write's: the read's first block will be block 2
        finalized = []
        weakref.finalize(small, lambda: finalized.append(h.async_pwrite(torch.ones(8, dtype=torch.uint8),
                                                                          f"{d}/b")))
        del small  # the requests hold the only references now
        reported = []

        def other_thread():
            wait_for_file(f"{gate}/held.2")  # the sync read is submitted: the main thread is inside the call
            os.kill(os.getpid(), signal.SIGUSR1)
            polled.wait()  # ...and its wait loop has polled the signal handlers: it covers the write
            open(f"{gate}/go.1", "w").close()
            reported.append(h.wait())
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=other_thread)
        t.start()
        try:
            h.sync_pread(buf, path)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("not interrupted")
        t.join()
        assert reported == [1], reported
        assert finalized == [0], finalized
        assert h.wait() == 1  # the finalizer's request
        with open(f"{d}/b", "rb") as f:
            assert f.read() == bytes([1]) * 8
        with open(f"{d}/a", "rb") as f:
            assert f.read() == torch.arange(1024, dtype=torch.int32).numpy().tobytes()
        h.free_cpu_locked_tensor(buf)
        print("ok")
    """, timeout=60)
    assert out.strip().endswith("ok"), out


# ----------------------------------------------------------------------------- paths

def test_nul_in_path_refused(aio_module: ModuleType, workdir: Path) -> None:
    """A path with an embedded NUL is a ValueError (str, bytes, PathLike) and nothing is created."""
    h = aio_module.aio_handle(4096, 4, False, False, 1)
    buf = torch.zeros(16, dtype=torch.uint8)
    for bad in (str(workdir / "a\0b"), os.fsencode(workdir / "a\0b"), workdir / "a\0b"):
        for call in (lambda b: h.sync_pwrite(buf, b), lambda b: h.async_pwrite(buf, b),
                     lambda b: h.pwrite(buf, b, False, False), lambda b: h.write(buf, b, False)):
            with pytest.raises(ValueError, match="NUL"):
                call(bad)
    assert list(workdir.iterdir()) == []
    assert h.wait() == 0


def test_non_utf8_paths(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """bytes, surrogate-escaped str and PathLike names with non-UTF-8 bytes work in every entry point; errors
    on them carry errno and the file name as os.fsdecode spells it."""
    h = aio_module.aio_handle(4096, 4, False, True, 2, engine=engine)
    raw = os.fsencode(workdir) + b"/caf\xe9-\xff.bin"
    src = torch.arange(10000, dtype=torch.int16)
    for name in (raw, os.fsdecode(raw), Path(os.fsdecode(raw))):
        assert h.sync_pwrite(src, name) == 1
        assert h.pwrite(src, name, True, False) == 1
        assert h.write(src, name, True) == 0
        back = torch.empty_like(src)
        assert h.async_pread(back, name) == 0
        assert h.wait() == 1
        assert torch.equal(back, src)
        assert h.read(back, name, True) == 0 and h.pread(back, name, False, False) == 1
    with open(raw, "rb") as f:
        assert f.read() == tbytes(src)
    assert aio_module.aio_write(src, raw, 4096, 8, False, False, True) == 0
    back = torch.empty_like(src)
    assert aio_module.aio_read(back, os.fsdecode(raw), 4096, 8, False, False, True) == 0
    assert torch.equal(back, src)
    missing = os.fsencode(workdir) + b"/gone-\xfe"
    for name in (missing, os.fsdecode(missing)):
        with pytest.raises(FileNotFoundError) as e:
            h.sync_pread(src, name)
        assert e.value.errno == errno.ENOENT and e.value.filename == os.fsdecode(missing)


# ----------------------------------------------------------------------------- views

def test_conjugate_and_negative_views(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Writing a conjugate or negative view writes the values it shows; reading into one is a ValueError that
    says so (the file's bytes would otherwise land as its raw bits)."""
    h = aio_module.aio_handle(4096, 4, False, True, 2, engine=engine)
    z = torch.randn(5000, dtype=torch.complex64)
    views = {"conj": z.conj(), "neg": z.conj().imag}
    for kind, v in views.items():
        assert v.is_conj() or v.is_neg(), kind
        path = str(workdir / kind)
        assert h.sync_pwrite(v, path) == 1
        back = torch.empty(v.shape, dtype=v.dtype)
        assert h.sync_pread(back, path) == 1
        assert torch.equal(back, v.resolve_conj().resolve_neg()), kind
        with pytest.raises(ValueError, match="conjugate|negative"):
            h.sync_pread(v, path)
        with pytest.raises(ValueError, match="conjugate|negative"):
            h.async_pread(v, path)
    assert h.wait() == 0


# ----------------------------------------------------------------------------- block sizes

@pytest.mark.parametrize("locked", [True, False], ids=["locked", "plain"])
def test_block_size_up_to_tensor_size(aio_module: ModuleType, engine: str, workdir: Path,
                                      locked: bool) -> None:
    """block_size equal to, just above and far above the tensor's size works on every engine."""
    size = 3 * MiB + 4096
    data = os.urandom(size)
    for bs in (size, size + 1, 1 << 40):
        h = aio_module.aio_handle(bs, 4, False, True, 2, engine=engine)
        src = h.new_cpu_locked_tensor(size, U8) if locked else torch.empty(size + 1, dtype=torch.uint8)[1:]
        src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        path = str(workdir / f"b{bs}")
        assert h.sync_pwrite(src, path, 4096) == 1
        dst = torch.zeros(size, dtype=torch.uint8)
        assert h.sync_pread(dst, path, 4096) == 1
        assert tbytes(dst) == data, bs


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def test_block_of_4gib_or_more(workdir: Path) -> None:
    """One block above 4 GiB (io_uring takes 32-bit lengths) reads a sparse file correctly on every engine."""
    size = (4 << 30) + 8192
    if _mem_available() < 3 * size:
        pytest.skip(f"needs {3 * size >> 30} GiB of available memory for a {size >> 30} GiB tensor")
    out = run_child(workdir, """
        size = (4 << 30) + 8192
        path = f"{d}/sparse4g"
        with open(path, "wb") as f:
            f.truncate(size)
            f.seek(size - 5)
            f.write(b"tail!")
        for engine in m.available_engines():
            h = m.aio_handle(size, 4, False, True, 1, engine=engine)
            t = torch.full((size,), 1, dtype=torch.uint8)
            assert h.sync_pread(t, path) == 1
            assert bytes(t[-5:].tolist()) == b"tail!"
            assert int(t[:-5].count_nonzero()) == 0, engine
            del t
        print("ok")
    """, timeout=600)
    assert out.strip() == "ok"


# ----------------------------------------------------------------------------- alignment

@pytest.mark.parametrize("par", [1, 2, 3])
def test_get_alignment_is_deepspeeds(aio_module: ModuleType, workdir: Path, par: int) -> None:
    """get_alignment() is DeepSpeed's 512 x P, and DeepSpeed-sized buffers (3 KiB at P=1, 64,000,000 bytes)
    written at multiples of it read back intact."""
    h = aio_module.aio_handle(MiB, 8, False, True, par)
    assert h.get_alignment() == 512 * par
    for size in (3 * KiB, 6 * h.get_alignment(), 64_000_000 // 8):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8)
        path = str(workdir / f"a{size}")
        for off in (0, h.get_alignment(), 7 * h.get_alignment()):
            assert h.sync_pwrite(data, path, off) == 1
            back = torch.empty_like(data)
            assert h.sync_pread(back, path, off) == 1
            assert torch.equal(back, data), (size, off)


# ----------------------------------------------------------------------------- warnings as errors

@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh ramfs mount (a file system that refuses O_DIRECT, so the handle warns)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a ramfs")
    with mounted(tmp_path / "ramfs", "ramfs") as mnt:
        yield mnt


def test_warning_as_error_leaves_nothing_half_done(aio_module: ModuleType, ramfs: Path) -> None:
    """With warnings turned into errors, the O_DIRECT-refused warning raises before any I/O: the request is
    dropped whole (nothing written, nothing pending) and the handle goes on working."""
    h = aio_module.aio_handle(4096, 4, False, True, 2)
    path = ramfs / "f"
    src = torch.full((100000,), 5, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning):
            h.sync_pwrite(src, str(path))
        assert path.read_bytes() == b""  # opened (created) but not written
        assert h.wait() == 0
        assert h.sync_pwrite(src, str(path)) == 1  # warned once per file system: now it just works
    assert path.read_bytes() == bytes([5]) * 100000
