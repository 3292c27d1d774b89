"""Completion per request: submit_pread/submit_pwrite return an id that wait_request() completes alone (its
byte count, or its own error) and request_done() polls, beside DeepSpeed's wait(), which never covers them.

Order is decided by the fault engine's hold@N (a block held until the test opens its gate), never by timing:
with intra_op_parallelism P, consecutive one-block requests go to different workers, so a held block stalls
its own request only.
"""

from __future__ import annotations

import errno
import gc
import os
import textwrap
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch
from child import run_in_child
from proc_stats import fd_count, vm_lck_kb
from thread_helpers import run_threads, wait_until

BLOCK = 4096
U8 = torch.empty(0, dtype=torch.uint8)


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def filled(n: int) -> tuple[torch.Tensor, bytes]:
    """A plain uint8 tensor of n random bytes, and the bytes."""
    data = os.urandom(n)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), data


@pytest.fixture
def gate(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fault engine's gate directory (hold@N announces held.N there and waits for go.N)."""
    d = workdir / "gate"
    d.mkdir()
    monkeypatch.setenv("DEEPNVME_FAULT_GATE", str(d))
    return d


@pytest.fixture
def fault(aio_module: ModuleType, monkeypatch: pytest.MonkeyPatch):
    """Factory: a fault-engine handle of one-block operations for the given rules."""
    def make(rules: str, par: int = 1):
        monkeypatch.setenv("DEEPNVME_FAULT", rules)
        return aio_module.aio_handle(BLOCK, 4, False, False, par, engine="fault")
    return make


def test_requests_complete_out_of_submission_order(fault, gate: Path, workdir: Path) -> None:
    """The first request's block is held: the second completes and is waited for on its own, the first stays
    not done, and completes once released; each returns its byte count and its bytes are right."""
    h = fault("hold@1", par=2)
    first, first_data = filled(BLOCK)
    first_id = h.submit_pwrite(first, str(workdir / "first"))
    wait_until(lambda: (gate / "held.1").exists(), "the first request's block held")
    (workdir / "second").write_bytes(os.urandom(BLOCK))
    second = torch.zeros(BLOCK, dtype=torch.uint8)
    second_id = h.submit_pread(second, str(workdir / "second"))
    assert second_id != first_id
    assert h.wait_request(second_id) == BLOCK
    assert tbytes(second) == (workdir / "second").read_bytes()
    assert h.request_done(first_id) is False
    (gate / "go.1").touch()
    assert h.wait_request(first_id) == BLOCK
    assert (workdir / "first").read_bytes() == first_data


def test_request_done_polls_without_handing_over(fault, gate: Path, workdir: Path) -> None:
    """request_done() is False while the block is held, True once it finished, and hands nothing over:
    wait_request() still returns the count afterwards, once."""
    h = fault("hold@1")
    t, data = filled(3 * BLOCK)
    rid = h.submit_pwrite(t, str(workdir / "f"), BLOCK)
    wait_until(lambda: (gate / "held.1").exists(), "the block held")
    assert h.request_done(rid) is False
    (gate / "go.1").touch()
    wait_until(lambda: h.request_done(rid), "the request done")
    assert h.request_done(rid) is True
    assert h.wait_request(rid) == 3 * BLOCK
    assert (workdir / "f").read_bytes()[BLOCK:] == data
    with pytest.raises(ValueError, match=f"request {rid} "):
        h.request_done(rid)


def test_wait_completed_names_requests_as_they_finish(fault, gate: Path, workdir: Path) -> None:
    """wait_completed() returns the ids of finished requests, each once, in the order they finish: the later
    request first while the earlier one is held; [] when the timeout passes first; nothing is handed over."""
    h = fault("hold@1", par=2)
    first, _ = filled(BLOCK)
    first_id = h.submit_pwrite(first, str(workdir / "first"))
    wait_until(lambda: (gate / "held.1").exists(), "the first request's block held")
    second_id = h.submit_pwrite(first, str(workdir / "second"))
    assert h.wait_completed() == [second_id]
    assert h.wait_completed(timeout=0.05) == []  # named once; the first is held
    (gate / "go.1").touch()
    assert h.wait_completed(timeout=60) == [first_id]
    assert h.wait_request(second_id) == BLOCK
    assert h.wait_request(first_id) == BLOCK
    with pytest.raises(ValueError, match="timeout"):
        h.wait_completed(timeout=-1)


def test_one_reaper_thread_completes_many_requests(aio_module: ModuleType, workdir: Path) -> None:
    """A single thread calling wait_completed() and wait_request() completes every request the main thread
    keeps submitting, each exactly once with its byte count: the shape of a queue with many in flight."""
    h = aio_module.aio_handle(64 << 10, 8, False, True, 2)
    sizes: dict[int, int] = {}
    got: dict[int, int] = {}
    total = 40

    def submit(i: int) -> None:
        n = 1000 * (i + 1)
        sizes[h.submit_pwrite(torch.full((n,), i % 256, dtype=torch.uint8), str(workdir / f"f{i}"))] = n

    for i in range(5):  # some finished before the reaper starts
        submit(i)
    stop = threading.Event()

    def reaper() -> None:
        while len(got) < total and not stop.is_set():
            for rid in h.wait_completed(timeout=0.05):
                assert rid not in got
                got[rid] = h.wait_request(rid)

    t = threading.Thread(target=reaper)
    t.start()
    try:
        for i in range(5, total):
            submit(i)
    finally:
        t.join(60)
        stop.set()
    assert not t.is_alive()
    assert got == sizes
    assert h.wait_completed(timeout=0) == []


def test_byte_count_is_the_tensors(aio_module: ModuleType, workdir: Path) -> None:
    """wait_request returns the request's bytes: any dtype, any size, zero included; by path, by descriptor
    and by os.PathLike."""
    h = aio_module.aio_handle(BLOCK, 8, False, False, 2)
    src = torch.arange(1001, dtype=torch.int32)
    path = workdir / "f"
    assert h.wait_request(h.submit_pwrite(src, str(path))) == 4004
    back = torch.empty_like(src)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert h.wait_request(h.submit_pread(back, fd)) == 4004
    finally:
        os.close(fd)
    assert torch.equal(back, src)
    part = torch.empty(10, dtype=torch.float64)
    assert h.wait_request(h.submit_pread(part, path, 4000 - 80)) == 80
    assert tbytes(part) == tbytes(src)[-84:-4]
    assert h.wait_request(h.submit_pread(torch.empty(0, dtype=torch.uint8), str(path))) == 0


def test_error_is_raised_by_its_own_waiter_only(fault, workdir: Path) -> None:
    """The request whose block fails with EIO raises OSError(EIO, filename) from its wait_request and from
    no other call: wait(), a sync call and another request's wait_request all succeed meanwhile."""
    h = fault("eio@2")
    ok, ok_data = filled(BLOCK)
    assert h.wait_request(h.submit_pwrite(ok, str(workdir / "ok"))) == BLOCK  # block 1
    bad, _ = filled(BLOCK)
    bad_id = h.submit_pwrite(bad, str(workdir / "bad"))  # block 2: EIO
    wait_until(lambda: h.request_done(bad_id), "the failing request done")
    assert h.async_pwrite(ok, str(workdir / "async")) == 0
    assert h.wait() == 1
    assert h.sync_pwrite(ok, str(workdir / "sync")) == 1
    other_id = h.submit_pread(torch.empty(BLOCK, dtype=torch.uint8), str(workdir / "ok"))
    assert h.wait_request(other_id) == BLOCK
    with pytest.raises(OSError) as exc:
        h.wait_request(bad_id)
    assert exc.value.errno == errno.EIO
    assert exc.value.filename == str(workdir / "bad")
    with pytest.raises(ValueError, match=f"request {bad_id} "):
        h.wait_request(bad_id)  # handed over once: its error was raised, it is gone
    assert h.wait() == 0
    assert (workdir / "async").read_bytes() == ok_data


def test_wait_does_not_cover_requests_of_their_own(fault, gate: Path, workdir: Path) -> None:
    """wait() and a sync call return while a submit_pwrite request is held, counting only their own requests;
    the held request is left for its wait_request."""
    h = fault("hold@1", par=3)
    held, held_data = filled(BLOCK)
    held_id = h.submit_pwrite(held, str(workdir / "held"))
    wait_until(lambda: (gate / "held.1").exists(), "the block held")
    t, _ = filled(BLOCK)
    assert h.async_pwrite(t, str(workdir / "a")) == 0
    assert h.wait() == 1
    assert h.sync_pwrite(t, str(workdir / "b")) == 1
    assert h.wait() == 0
    assert h.request_done(held_id) is False
    (gate / "go.1").touch()
    assert h.wait_request(held_id) == BLOCK
    assert (workdir / "held").read_bytes() == held_data


def test_unknown_ids_raise_value_error_naming_them(aio_module: ModuleType, workdir: Path) -> None:
    """An id never given, given by another handle, already handed over, zero or negative: ValueError naming
    it, from wait_request and request_done alike."""
    h = aio_module.aio_handle(BLOCK, 8, False, False, 1)
    other = aio_module.aio_handle(BLOCK, 8, False, False, 1)
    t, _ = filled(BLOCK)
    rid = other.submit_pwrite(t, str(workdir / "f"))
    for bad in (rid, 12345, 0, -7):
        with pytest.raises(ValueError, match=f"request {bad} "):
            h.wait_request(bad)
        with pytest.raises(ValueError, match=f"request {bad} "):
            h.request_done(bad)
    assert other.wait_request(rid) == BLOCK
    with pytest.raises(ValueError, match=f"request {rid} "):
        other.wait_request(rid)


def test_threads_wait_their_own_requests_on_one_handle(aio_module: ModuleType, workdir: Path) -> None:
    """Several threads submit to one shared handle and each waits for its own requests, newest first, while
    another thread uses async requests and wait(): every count and every byte is right, and wait() counts
    exactly the async requests."""
    h = aio_module.aio_handle(64 << 10, 8, False, True, 2)
    rounds, per_round = 5, 4
    waited: list[int] = []

    def own(k: int) -> None:
        for r in range(rounds):
            tensors = [filled((k + 1) * 50000 + i * 4096 + 1) for i in range(per_round)]
            paths = [workdir / f"own-{k}-{r}-{i}" for i in range(per_round)]
            ids = [h.submit_pwrite(t, str(p)) for (t, _), p in zip(tensors, paths)]
            for i in reversed(range(per_round)):
                assert h.wait_request(ids[i]) == len(tensors[i][1])
            backs = [torch.empty(len(d), dtype=torch.uint8) for _, d in tensors]
            ids = [h.submit_pread(b, str(p)) for b, p in zip(backs, paths)]
            for i in (2, 0, 3, 1):
                assert h.wait_request(ids[i]) == len(tensors[i][1])
                assert tbytes(backs[i]) == tensors[i][1]

    def deepspeed() -> None:
        for r in range(rounds):
            t, data = filled(300001)
            for i in range(3):
                assert h.async_pwrite(t, str(workdir / f"ds-{r}-{i}")) == 0
            waited.append(h.wait())
            for i in range(3):
                assert (workdir / f"ds-{r}-{i}").read_bytes() == data

    run_threads([lambda k=k: own(k) for k in range(3)] + [deepspeed])
    assert waited == [3] * rounds


def test_close_with_requests_never_waited_for(aio_module: ModuleType, workdir: Path) -> None:
    """A handle destroyed with requests not handed over finishes them and lets go of everything: no
    descriptor stays open, the tensors' storages are released (they can be resized again) and locked
    memory goes back to its baseline once the tensors are dropped."""
    (workdir / "src").write_bytes(os.urandom(1 << 20))
    gc.collect()
    fds, locked = fd_count(), vm_lck_kb()
    h = aio_module.aio_handle(64 << 10, 8, False, True, 2)
    pinned = [h.new_cpu_locked_tensor(1 << 20, U8) for _ in range(3)]
    locks_here = vm_lck_kb() > locked  # a sanitizer's mlock locks nothing: then only fds and storages count
    plain = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(3)]
    for i, t in enumerate(pinned + plain):
        if i % 2:
            fd = os.open(workdir / "src", os.O_RDONLY)
            h.submit_pread(t, fd)
            os.close(fd)  # the request keeps its own duplicate
        else:
            h.submit_pwrite(t, str(workdir / f"out{i}"))
    with pytest.raises(RuntimeError):
        plain[1].resize_(2 << 20)  # lent to a pending request (or handed over: then the next line fails)
    del h
    gc.collect()
    assert fd_count() == fds
    for t in plain:
        t.resize_(2 << 20)  # no request holds its storage now
    for i in range(0, 6, 2):
        assert (workdir / f"out{i}").stat().st_size == 1 << 20
    del pinned, plain, t
    gc.collect()
    if locks_here:
        assert vm_lck_kb() == locked


PRELUDE = textwrap.dedent("""
    import os, signal, sys, threading, time
    import torch
    from op_builder import AsyncIOBuilder
    m = AsyncIOBuilder().load()
    from tests.support.forks import reap_child
    from tests.support.thread_helpers import wait_until
    d = sys.argv[1]
    gate = f"{d}/gate"
    os.mkdir(gate)
    os.environ.update(DEEPNVME_FAULT="hold@1", DEEPNVME_FAULT_GATE=gate)

    def wait_for_file(path, limit=60):
        wait_until(lambda: os.path.exists(path), path, limit)
""")


def test_ctrl_c_while_waiting_for_one_request(workdir: Path) -> None:
    """A real SIGINT while wait_request waits for a held block raises KeyboardInterrupt from wait_request;
    the request is not cancelled: it stays pending under its id, completes with its bytes once released,
    and the handle stays usable. The SIGINT is sent only once the call has begun (a profile hook sees it
    entered), and the handler raises only inside it, so it cannot land between submit and wait."""
    out = run_in_child(workdir, PRELUDE + textwrap.dedent("""
        import sys
        h = m.aio_handle(1 << 20, 4, False, True, 1, engine="fault")
        data = os.urandom(3 << 20)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rid = h.submit_pwrite(src, f"{d}/f")
        wait_for_file(f"{gate}/held.1")
        # A plain flag, set last in the hook: nothing between it and the call can run a signal handler (an
        # Event's set() could, and the KeyboardInterrupt would come from the hook).
        inside = [False]
        raised_from = []

        def profile(frame, event, arg):
            if getattr(arg, "__name__", "") == "wait_request":
                if event == "c_exception":
                    raised_from.append("wait_request")
                elif event == "c_call":
                    inside[0] = True

        def on_sigint(signum, frame):
            if inside[0]:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)

        def interrupter():
            while not inside[0]:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=interrupter)
        t.start()
        sys.setprofile(profile)
        try:
            h.wait_request(rid)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("wait_request returned while its block was held")
        finally:
            sys.setprofile(None)
        t.join()
        assert raised_from == ["wait_request"], raised_from
        assert h.request_done(rid) is False  # still held, still pending: not cancelled
        open(f"{gate}/go.1", "w").close()
        assert h.wait_request(rid) == len(data)
        with open(f"{d}/f", "rb") as f:
            assert f.read() == data
        assert h.wait() == 0
        small = torch.arange(1000, dtype=torch.int32)
        assert h.wait_request(h.submit_pwrite(small, f"{d}/after")) == 4000
        back = torch.empty_like(small)
        assert h.sync_pread(back, f"{d}/after") == 1
        assert torch.equal(back, small)
        print("ok")
    """), timeout=120)
    assert out.strip() == "ok", out


def test_fork_child_refuses_and_parent_request_completes(workdir: Path) -> None:
    """A child forked while a request is pending (held) gets RuntimeError naming fork from submit_*,
    wait_request and request_done on the inherited handle, and exits cleanly; the parent's request then
    completes with its bytes."""
    out = run_in_child(workdir, PRELUDE + textwrap.dedent("""
        h = m.aio_handle(1 << 20, 4, False, True, 1, engine="fault")
        data = os.urandom(1 << 20)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rid = h.submit_pwrite(src, f"{d}/f")
        wait_for_file(f"{gate}/held.1")
        pid = os.fork()
        if pid == 0:
            calls = [lambda: h.submit_pread(torch.empty(8, dtype=torch.uint8), f"{d}/f"),
                     lambda: h.submit_pwrite(torch.empty(8, dtype=torch.uint8), f"{d}/g"),
                     lambda: h.wait_request(rid), lambda: h.request_done(rid)]
            for i, call in enumerate(calls):
                try:
                    call()
                except RuntimeError as e:
                    assert "fork" in str(e), (i, e)
                else:
                    raise AssertionError(f"call {i}: an inherited handle took work")
            sys.exit(0)  # a normal exit: the inherited handle is destroyed at interpreter shutdown
        assert reap_child(pid, 60) == 0
        assert h.request_done(rid) is False
        open(f"{gate}/go.1", "w").close()
        assert h.wait_request(rid) == len(data)
        with open(f"{d}/f", "rb") as f:
            assert f.read() == data
        print("ok")
    """), timeout=120)
    assert out.strip() == "ok", out
