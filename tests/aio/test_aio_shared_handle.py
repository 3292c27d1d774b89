"""The thread contract of a handle shared by threads (README, "Guarantees"): wait() returns only when every
request pending at its call has completed, whoever submitted it; a request's error is raised by the wait()
calls that cover it and never by another thread's sync call; a sync call raises only its own error."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from thread_helpers import run_threads

KiB = 1 << 10
THREADS = 8
U8 = torch.empty(0, dtype=torch.uint8)


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor."""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_wait_covers_requests_other_threads_collect(aio_module: ModuleType, engine: str,
                                                   workdir: Path) -> None:
    """8 threads mix async reads/writes, sync calls and wait() on one handle: after each thread's wait() its
    own async requests are complete (buffers hold the file's bytes, files hold the buffers'), even when
    another thread's wait() or sync call collected them."""
    h = aio_module.aio_handle(64 * KiB, 8, False, True, 2, engine=engine)
    sizes = [256 * KiB + 7, 512 * KiB, 384 * KiB + 4096]

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            rng = torch.Generator().manual_seed(k)
            for rnd in range(6):
                reads, writes = [], []
                for i, size in enumerate(sizes):
                    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=rng)
                    path = workdir / f"t{k}-{rnd}-{i}"
                    if i % 2 == 0:
                        path.write_bytes(tbytes(data))
                        if (k + i) % 2:
                            dst = torch.zeros(size, dtype=torch.uint8)
                        else:
                            dst = h.new_cpu_locked_tensor(size, U8)
                        assert h.async_pread(dst, str(path)) == 0
                        reads.append((dst, data))
                    else:
                        assert h.async_pwrite(data, str(path)) == 0
                        writes.append((path, data))
                if k % 3 == 0:
                    # A sync call in the middle: it returns its own request plus clean async ones it covered.
                    own = torch.randint(0, 256, (100 * KiB,), dtype=torch.uint8, generator=rng)
                    assert h.sync_pwrite(own, str(workdir / f"s{k}-{rnd}")) >= 1
                h.wait()  # count depends on what other threads collected; completion must not
                for dst, data in reads:
                    assert torch.equal(dst, data), f"thread {k} round {rnd}: a read incomplete at wait()"
                for path, data in writes:
                    assert path.read_bytes() == tbytes(data), f"thread {k} round {rnd}: {path.name} short"
        return run

    run_threads([worker(k) for k in range(THREADS)])
    assert h.wait() == 0


def test_sync_call_does_not_raise_async_error(aio_module: ModuleType, workdir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread: an async write fails, a sync write to another file succeeds (its own request is fine), then
    wait() raises the async error with its file name; nothing stays pending."""
    monkeypatch.setenv("DEEPNVME_FAULT", "eio@1")
    h = aio_module.aio_handle(4096, 4, False, False, 1, engine="fault")
    src = h.new_cpu_locked_tensor(8192, U8)
    src.copy_(torch.randint(0, 256, (8192,), dtype=torch.uint8))
    assert h.async_pwrite(src, str(workdir / "bad")) == 0
    ok = workdir / "ok"
    assert h.sync_pwrite(src, str(ok)) == 1  # the failed async request is not counted, nor raised, here
    assert ok.read_bytes() == tbytes(src)
    with pytest.raises(OSError) as exc:
        h.wait()
    assert exc.value.errno == errno.EIO and exc.value.filename == str(workdir / "bad")
    assert h.wait() == 0


def test_errors_reach_covering_waits_only(aio_module: ModuleType, workdir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """8 threads share a fault-engine handle where exactly one block fails. Whichever request it hits: a sync
    call raises only for its own file, and a failed async request is raised by at least one wait() and by no
    sync call."""
    for nth in (3, 17, 40, 77):
        monkeypatch.setenv("DEEPNVME_FAULT", f"eio@{nth}")
        h = aio_module.aio_handle(4096, 4, False, True, 2, engine="fault")
        raised: list[tuple[str, str, str]] = []  # (kind of call, thread's own file or "", failing file)
        async_paths: set[str] = set()
        lock = threading.Lock()

        def worker(k: int, h=h, raised=raised, async_paths=async_paths, lock=lock,
                   nth=nth) -> Callable[[], None]:
            def run() -> None:
                src = torch.full((3 * 4096,), k, dtype=torch.uint8)
                # 80 requests of 3 blocks: at least 80 operations even where every source is misaligned
                # and its 3 blocks go to the device as one staged operation, so eio@77 always happens.
                for i in range(10):
                    path = str(workdir / f"n{nth}-{k}-{i}")
                    if (k + i) % 2:
                        try:
                            h.sync_pwrite(src, path)
                        except OSError as e:
                            with lock:
                                raised.append(("sync", path, e.filename))
                    else:
                        with lock:
                            async_paths.add(path)
                        assert h.async_pwrite(src, path) == 0
                        try:
                            h.wait()
                        except OSError as e:
                            with lock:
                                raised.append(("wait", "", e.filename))
            return run

        run_threads([worker(k) for k in range(THREADS)])
        assert h.wait() == 0
        assert raised, f"eio@{nth}: the failure was never raised"
        failing = {f for _, _, f in raised}
        assert len(failing) == 1, raised  # one failed block, one failed request
        (bad,) = failing
        for kind, own, f in raised:
            if kind == "sync":
                assert f == own, f"a sync call raised another request's error: {raised}"
        if bad in async_paths:
            assert all(kind == "wait" for kind, _, _ in raised), raised
        else:
            assert [kind for kind, _, _ in raised] == ["sync"], raised
        del h


def test_threads_sync_only_each_get_their_own_bytes(aio_module: ModuleType, engine: str,
                                                   workdir: Path) -> None:
    """8 threads doing only sync calls on one handle with P=3: each call returns 1 and its own bytes."""
    h = aio_module.aio_handle(32 * KiB, 4, False, True, 3, engine=engine)

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            path = str(workdir / f"o{k}")
            for i in range(8):
                data = os.urandom(64 * KiB * (1 + i % 3) + k)
                src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                assert h.sync_pwrite(src, path, 512 * i) == 1
                dst = torch.empty(len(data), dtype=torch.uint8)
                assert h.sync_pread(dst, path, 512 * i) == 1
                assert tbytes(dst) == data
        return run

    run_threads([worker(k) for k in range(THREADS)])
