"""Requests addressed by a caller's descriptor share one duplicate of it while it holds the same file.

Each request targets the file its descriptor held at submission, even when the caller closes the descriptor
right after and its number is reused for another file; yet thousands of queued requests by one descriptor
must not cost thousands of descriptors (a load of many small tensors under `ulimit -n 1024` failed with
EMFILE). Real files and handles; whatever lowers RLIMIT_NOFILE or forks runs in a child process.
"""

from __future__ import annotations

import errno
import json
import os
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from child import run_in_child

BLOCK = 4096


def tbytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).numpy().tobytes()


def run_child(workdir: Path, body: str, timeout: float = 300) -> dict:
    """Run `body` in a fresh interpreter (the op as `m`, the work folder as `d`); give its last JSON line."""
    prelude = textwrap.dedent("""
        import errno, json, os, resource, sys, time
        import torch
        from op_builder import AsyncIOBuilder
        m = AsyncIOBuilder().load()
        d = sys.argv[1]

        def fd_count():
            return len(os.listdir("/proc/self/fd"))
    """)
    out = run_in_child(workdir, prelude + textwrap.dedent(body), timeout)
    return json.loads(out.strip().splitlines()[-1])


def test_thousands_of_queued_reads_by_one_descriptor_under_a_low_fd_limit(workdir: Path) -> None:
    """3000 async reads queued by one descriptor with RLIMIT_NOFILE at 256: all are accepted, the process
    holds a few descriptors more than before while they are queued, and each read gets its own block. One
    worker at queue depth 1 keeps most of them pending (a duplicate per request hit EMFILE after ~1000).
    Then, with every descriptor taken, a request by a descriptor no pending request holds says EMFILE."""
    out = run_child(workdir, """
        n, block = 3000, 4096
        path = os.path.join(d, "blocks.bin")
        data = torch.randint(0, 256, (n * block,), dtype=torch.uint8)
        with open(path, "wb") as f:
            f.write(data.numpy().tobytes())
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        h = m.aio_handle(block, 1, False, True, 1)
        fd = os.open(path, os.O_RDONLY)
        dst = torch.zeros(n * block, dtype=torch.uint8)
        base = peak = fd_count()
        queued, error = 0, None
        try:
            for i in range(n):
                h.async_pread(dst[i * block:(i + 1) * block], fd, i * block)
                queued += 1
                if i % 25 == 0:
                    peak = max(peak, fd_count())
        except OSError as exc:
            error = [exc.errno, str(exc)]
        waited = h.wait()
        same = bool(torch.equal(dst, data))
        # Every descriptor taken: a new duplicate is impossible, and the error must say so.
        other = os.open(path, os.O_RDONLY)
        filler = []
        while True:
            try:
                filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        try:
            h.sync_pread(torch.zeros(block, dtype=torch.uint8), other, 0)
            full = None
        except OSError as exc:
            full = [exc.errno, str(exc), exc.filename]
        for f in filler:
            os.close(f)
        print(json.dumps({"base": base, "peak": peak, "queued": queued, "error": error, "waited": waited,
                          "same": same, "full": full, "other": other}))
    """)
    assert out["error"] is None and out["queued"] == 3000, out
    assert out["waited"] == 3000 and out["same"], out
    # One shared duplicate (plus the odd descriptor of the interpreter) instead of one per pending request.
    assert out["peak"] - out["base"] <= 4, out
    code, text, name = out["full"]
    assert code == errno.EMFILE, out["full"]
    assert "too many open files" in text.lower() and "not an open file descriptor" not in text, text
    assert name == f"<fd {out['other']}>"


def test_number_reused_for_another_file_after_submission(aio_module: ModuleType, workdir: Path) -> None:
    """Reads queued by fd N, N closed and reopened on another file, more reads queued by N: each read gets
    the bytes of the file N held when it was submitted. The same file reopened read-write at N takes a write
    (the pending reads' read-only duplicate is not reused for it)."""
    h = aio_module.aio_handle(BLOCK, 1, False, True, 1)
    n = 64
    a, b = workdir / "a.bin", workdir / "b.bin"
    data_a = torch.randint(0, 256, (n * BLOCK,), dtype=torch.uint8)
    data_b = torch.randint(0, 256, (n * BLOCK,), dtype=torch.uint8)
    a.write_bytes(tbytes(data_a))
    b.write_bytes(tbytes(data_b))
    got_a = torch.zeros(n * BLOCK, dtype=torch.uint8)
    got_b = torch.zeros(n * BLOCK, dtype=torch.uint8)
    fd = os.open(a, os.O_RDONLY)
    for i in range(n):
        h.async_pread(got_a[i * BLOCK:(i + 1) * BLOCK], fd, i * BLOCK)
    os.close(fd)
    again = os.open(b, os.O_RDONLY)
    try:
        assert again == fd, "the test needs the number reused"
        for i in range(n):
            h.async_pread(got_b[i * BLOCK:(i + 1) * BLOCK], again, i * BLOCK)
    finally:
        os.close(again)
    assert h.wait() == 2 * n
    assert torch.equal(got_a, data_a) and torch.equal(got_b, data_b)

    # Same file, same number, another access mode: pending reads hold a read-only duplicate of a.
    fd = os.open(a, os.O_RDONLY)
    for i in range(n):
        h.async_pread(got_a[i * BLOCK:(i + 1) * BLOCK], fd, i * BLOCK)
    os.close(fd)
    rw = os.open(a, os.O_RDWR)
    try:
        assert rw == fd, "the test needs the number reused"
        ones = torch.full((BLOCK,), 1, dtype=torch.uint8)
        h.async_pwrite(ones, rw, n * BLOCK)
    finally:
        os.close(rw)
    assert h.wait() == n + 1
    assert torch.equal(got_a, data_a)
    assert a.read_bytes()[n * BLOCK:] == bytes([1]) * BLOCK


def test_closed_descriptor_still_says_so(aio_module: ModuleType, workdir: Path) -> None:
    """A descriptor closed after requests by it were queued is EBADF for the next one, not served by the
    pending requests' duplicate."""
    h = aio_module.aio_handle(BLOCK, 1, False, True, 1)
    path = workdir / "c.bin"
    path.write_bytes(bytes(16 * BLOCK))
    fd = os.open(path, os.O_RDONLY)
    buf = torch.zeros(16 * BLOCK, dtype=torch.uint8)
    h.pread(buf, fd, True, True, 0)  # validated async: holds its duplicate until wait()
    os.close(fd)
    with pytest.raises(OSError) as exc:
        h.sync_pread(torch.zeros(BLOCK, dtype=torch.uint8), fd, 0)
    assert exc.value.errno == errno.EBADF and "not an open file descriptor" in str(exc.value)
    assert h.wait() == 1


def test_forked_child_makes_its_own_duplicates(workdir: Path) -> None:
    """A child forked while the parent's request holds a duplicate of fd N may close that duplicate and put
    another file at its number: its own reads by N still get N's file, not whatever the inherited number
    holds now."""
    out = run_child(workdir, """
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded, use of fork() may deadlock"
        block = 4096
        a, c = os.path.join(d, "a.bin"), os.path.join(d, "c.bin")
        with open(a, "wb") as f:
            f.write(bytes([0xA]) * block)
        with open(c, "wb") as f:
            f.write(bytes([0xC]) * block)
        h = m.aio_handle(block, 1, False, True, 1)
        fd = os.open(a, os.O_RDONLY)
        held = torch.zeros(block, dtype=torch.uint8)
        h.pread(held, fd, True, True, 0)  # validated async: keeps its duplicate until wait()
        dups = [int(n) for n in os.listdir("/proc/self/fd") if int(n) != fd and
                os.path.realpath(f"/proc/self/fd/{n}") == os.path.realpath(a)]
        assert dups, "no duplicate of the descriptor is held"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.set_num_threads(1)  # torch's OpenMP pool is not fork-safe (libgomp): not ours to test
                other = os.open(c, os.O_RDONLY)
                for n in dups:
                    os.dup2(other, n)  # the inherited duplicate's number now holds another file
                os.close(other)
                child = m.aio_handle(block, 1, False, True, 1)
                got = torch.zeros(block, dtype=torch.uint8)
                assert child.sync_pread(got, fd, 0) == 1
                code = 0 if bytes(got.numpy().tobytes()) == bytes([0xA]) * block else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        waited = h.wait()
        print(json.dumps({"child": os.waitstatus_to_exitcode(status), "waited": waited,
                          "held": bool((held == 0xA).all())}))
    """, timeout=120)
    assert out == {"child": 0, "waited": 1, "held": True}, out
