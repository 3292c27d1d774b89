"""The inline path (a small sync request runs on the caller's thread) and staged runs of the staging pool.

A sync request whose body is one engine operation skips the worker hand-off; these tests hold it to the
same contract as the workers: errors name the file and errno, a short transfer never reports success,
threads may share a handle, a sync call still covers the async requests pending when it starts, and staged
(unaligned) memory still round-trips when the pool is too small for every worker at once.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from thread_helpers import run_threads

U8 = torch.empty(0, dtype=torch.uint8)
REPO = Path(__file__).resolve().parents[2]


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous uint8 tensor."""
    return t.numpy().tobytes()


def empty(n: int, misaligned: bool = False) -> torch.Tensor:
    """A plain uint8 tensor of n bytes; misaligned: at an odd address, so its body must be staged."""
    return torch.empty(n + 1, dtype=torch.uint8)[1:] if misaligned else torch.empty(n, dtype=torch.uint8)


def from_bytes(data: bytes, misaligned: bool = False) -> torch.Tensor:
    """A plain uint8 tensor holding `data`; misaligned: at an odd address, so its body must be staged."""
    t = empty(len(data), misaligned)
    t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t


@pytest.mark.parametrize("by_fd", [False, True])
@pytest.mark.parametrize("misaligned", [False, True])
def test_small_sync_roundtrip(aio_module: ModuleType, engine: str, workdir: Path, by_fd: bool,
                              misaligned: bool) -> None:
    """Block-sized and smaller sync transfers, aligned or with edges, by path and by descriptor."""
    h = aio_module.aio_handle(65536, 4, False, False, 1, engine=engine)
    path = workdir / "f"
    before = os.urandom(300000)
    path.write_bytes(before)
    expect = bytearray(before)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT) if by_fd else -1
    try:
        for size, off in ((4096, 8192), (512, 512), (65536, 0), (100, 1000), (5000, 4000), (65536, 4097)):
            data = os.urandom(size)
            target = fd if by_fd else str(path)
            assert h.sync_pwrite(from_bytes(data, misaligned), target, off) == 1
            expect[off:off + size] = data
            back = empty(size, misaligned)
            assert h.sync_pread(back, target, off) == 1
            assert tbytes(back) == data
    finally:
        if fd >= 0:
            os.close(fd)
    assert path.read_bytes() == bytes(expect)


def test_read_to_end_of_odd_sized_file(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """A read ending at an end of file that is not block-aligned: direct body, buffered tail, all bytes."""
    h = aio_module.aio_handle(1 << 20, 4, False, False, 1, engine=engine)
    path = workdir / "odd"
    data = os.urandom(3 * 4096 + 777)
    path.write_bytes(data)
    t = torch.empty(len(data) - 4096, dtype=torch.uint8)
    h.sync_pread(t, str(path), 4096)
    assert tbytes(t) == data[4096:]
    with pytest.raises(ValueError, match="past end of file"):
        h.sync_pread(torch.empty(4096, dtype=torch.uint8), str(path), len(data) - 100)


def test_inline_errors_name_file_and_errno(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Errors of an inline request: missing file, read-only descriptor, directory, bad offset."""
    h = aio_module.aio_handle(1 << 20, 4, False, False, 1, engine=engine)
    t = torch.zeros(4096, dtype=torch.uint8)
    missing = workdir / "missing"
    with pytest.raises(FileNotFoundError) as e:
        h.sync_pread(t, str(missing))
    assert e.value.filename == str(missing)
    path = workdir / "ro"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(OSError) as e:
            h.sync_pwrite(t, fd, 0)  # the descriptor cannot write: the kernel's EBADF, raised
        assert e.value.errno == errno.EBADF
        assert f"<fd {fd}>" in str(e.value)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 8192
    with pytest.raises(IsADirectoryError):
        h.sync_pwrite(t, str(workdir))
    with pytest.raises(ValueError, match="file_offset"):
        h.sync_pread(t, str(path), -4096)
    # The handle still works after each failure.
    h.sync_pwrite(t, str(path), 4096)
    assert path.read_bytes()[4096:] == bytes(4096)


def test_short_write_is_an_error(workdir: Path) -> None:
    """A write cut short by RLIMIT_FSIZE (a real partial pwrite, then EFBIG) raises; it never succeeds."""
    script = textwrap.dedent(f"""
        import errno, os, resource, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        import torch
        from op_builder import AsyncIOBuilder
        aio = AsyncIOBuilder().load()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        path = {str(workdir / "capped")!r}
        for engine in aio.available_engines():
            h = aio.aio_handle(1 << 20, 4, False, False, 1, engine=engine)
            if os.path.exists(path):
                os.unlink(path)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
            try:
                h.sync_pwrite(torch.ones(16384, dtype=torch.uint8), path, 0)
            except OSError as e:
                assert e.errno == errno.EFBIG, (engine, e)
                assert e.filename == path, (engine, e)
            else:
                raise SystemExit(engine + ": a write past RLIMIT_FSIZE reported success")
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_threads_share_a_handle(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """Eight threads each write and read back their own blocks through one handle, inline at once."""
    h = aio_module.aio_handle(8192, 4, False, False, 1, engine=engine)
    path = workdir / "shared"
    path.write_bytes(bytes(8 * 20 * 8192))

    def worker(k: int) -> None:
        for i in range(20):
            off = (k * 20 + i) * 8192
            data = bytes([k * 20 + i]) * 8192
            h.sync_pwrite(from_bytes(data, misaligned=(i % 2 == 1)), str(path), off)
            back = torch.empty(8192, dtype=torch.uint8)
            h.sync_pread(back, str(path), off)
            assert tbytes(back) == data

    run_threads([lambda k=k: worker(k) for k in range(8)])
    got = path.read_bytes()
    for n in range(160):
        assert got[n * 8192:(n + 1) * 8192] == bytes([n]) * 8192


def test_sync_call_covers_pending_async(aio_module: ModuleType, engine: str, workdir: Path) -> None:
    """An inline sync call still waits for the async requests pending when it starts, as the workers' did."""
    h = aio_module.aio_handle(1 << 20, 8, False, False, 2, engine=engine)
    big, small = workdir / "big", workdir / "small"
    small.write_bytes(os.urandom(4096))
    data = os.urandom(8 << 20)
    h.async_pwrite(from_bytes(data), str(big))
    assert h.sync_pread(torch.empty(4096, dtype=torch.uint8), str(small)) == 2  # its own and the async one
    assert big.read_bytes() == data
    assert h.wait() == 0


def test_staged_runs_with_a_starved_pool(workdir: Path) -> None:
    """Blocks larger than a staging buffer, a pool of four buffers, three handles at once: every byte lands.

    Each staged operation needs a run of contiguous buffers; with so few, workers wait for one another's
    releases (a condition variable, no timer) and nothing deadlocks.
    """
    script = textwrap.dedent(f"""
        import os, sys, threading
        sys.path.insert(0, {str(REPO)!r})
        import torch
        from op_builder import AsyncIOBuilder
        aio = AsyncIOBuilder().load()
        d = {str(workdir)!r}
        errors = []
        def run(k):
            try:
                h = aio.aio_handle(3 * 65536, 8, False, True, 2)
                data = os.urandom((5 << 20) + 123)
                src = torch.empty(len(data) + 1, dtype=torch.uint8)[1:]
                src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                path = os.path.join(d, f"f{{k}}")
                for _ in range(3):
                    h.sync_pwrite(src, path, 512)
                    back = torch.empty(len(data) + 1, dtype=torch.uint8)[1:]
                    h.sync_pread(back, path, 512)
                    assert back.numpy().tobytes() == data
            except BaseException as e:
                errors.append(e)
        threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
        for t in threads: t.start()
        for t in threads: t.join(120)
        assert not any(t.is_alive() for t in threads), "hung"
        assert not errors, errors
        print("ok")
    """)
    env = dict(os.environ, DEEPNVME_STAGING_BUFFERS="4", DEEPNVME_STAGING_BUFFER_BYTES="64K")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
