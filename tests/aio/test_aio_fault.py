"""Error paths a disk cannot produce on demand, injected by the test-only 'fault' engine (DEEPNVME_FAULT)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch
from thread_helpers import wait_until

BLOCK = 4096
U8 = torch.empty(0, dtype=torch.uint8)


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bounded(fn, timeout: float = 30.0):
    """Call fn in a daemon thread; fail instead of hanging the suite if it does not return in time."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "call hung"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


@pytest.fixture
def fault(aio_module: ModuleType, monkeypatch: pytest.MonkeyPatch):
    """Factory: a fault-engine handle (P=1 so block numbering is deterministic) for the given rules."""
    def make(rules: str, qd: int = 4, single_submit: bool = False, overlap: bool = False, par: int = 1):
        monkeypatch.setenv("DEEPNVME_FAULT", rules)
        h = aio_module.aio_handle(BLOCK, qd, single_submit, overlap, par, engine="fault")
        assert h.get_engine() == "fault"
        return h
    return make


def aligned(h, nblocks: int) -> tuple[torch.Tensor, bytes]:
    """A locked buffer of whole blocks filled with random bytes."""
    data = os.urandom(nblocks * BLOCK)
    t = h.new_cpu_locked_tensor(len(data), U8)
    t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t, data


def check_usable(h, workdir: Path) -> None:
    """After a failure nothing is pending and the handle still moves correct data."""
    assert h.wait() == 0
    src, data = aligned(h, 3)
    assert h.sync_pwrite(src, str(workdir / "after")) == 1
    dst = torch.zeros(len(data), dtype=torch.uint8)
    assert h.sync_pread(dst, str(workdir / "after")) == 1
    assert tbytes(dst) == data


def test_clean_fault_engine_moves_data(fault, workdir: Path) -> None:
    """With a rule that never fires, the fault engine is a correct engine."""
    h = fault("eio@1000000")
    src, data = aligned(h, 8)
    assert h.sync_pwrite(src, str(workdir / "f")) == 1
    assert (workdir / "f").read_bytes() == data


@pytest.mark.parametrize("kind", ["read", "write"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_eio(fault, workdir: Path, kind: str, n: int) -> None:
    """The N-th block completing with -EIO raises OSError EIO naming the file; the handle survives."""
    h = fault(f"eio@{n}")
    path = workdir / "f"
    src, data = aligned(h, 4)
    if kind == "read":
        path.write_bytes(data)
    with pytest.raises(OSError) as exc:
        bounded(lambda: h.sync_pread(src, str(path)) if kind == "read" else h.sync_pwrite(src, str(path)))
    assert exc.value.errno == errno.EIO
    assert exc.value.filename == str(path)
    check_usable(h, workdir)


@pytest.mark.parametrize("call", ["sync_pwrite", "write", "async_pwrite"])
def test_enospc(fault, workdir: Path, call: str) -> None:
    """An injected -ENOSPC raises OSError ENOSPC from the call or from its wait()."""
    h = fault("enospc@2")
    path = str(workdir / "f")
    src, _ = aligned(h, 4)
    with pytest.raises(OSError) as exc:
        if call == "sync_pwrite":
            bounded(lambda: h.sync_pwrite(src, path))
        elif call == "write":
            bounded(lambda: h.write(src, path, False))
        else:
            assert h.async_pwrite(src, path) == 0
            bounded(h.wait)
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == path
    check_usable(h, workdir)


@pytest.mark.parametrize("kind", ["read", "write"])
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_short_transfer_is_resubmitted(fault, workdir: Path, kind: str, n: int, overlap: bool) -> None:
    """A block that moves only half its bytes is completed by resubmitting the rest: correct data, count 1."""
    h = fault(f"short@{n}", overlap=overlap)
    path = workdir / "f"
    src, data = aligned(h, 4)
    if kind == "read":
        path.write_bytes(data)
        src.zero_()
        assert bounded(lambda: h.sync_pread(src, str(path))) == 1
        assert tbytes(src) == data
    else:
        assert bounded(lambda: h.sync_pwrite(src, str(path))) == 1
        assert path.read_bytes() == data
    assert h.wait() == 0


@pytest.mark.parametrize("kind", ["read", "write"])
@pytest.mark.parametrize("n", [1, 3])
def test_zero_progress_raises(fault, workdir: Path, kind: str, n: int) -> None:
    """A block that never makes progress raises OSError EIO 'short transfer' instead of looping or passing."""
    h = fault(f"zero@{n}")
    path = workdir / "f"
    src, data = aligned(h, 4)
    if kind == "read":
        path.write_bytes(data)
    with pytest.raises(OSError) as exc:
        bounded(lambda: h.sync_pread(src, str(path)) if kind == "read" else h.sync_pwrite(src, str(path)))
    assert exc.value.errno == errno.EIO
    assert "short transfer" in str(exc.value)
    assert exc.value.filename == str(path)
    check_usable(h, workdir)


@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("par", [1, 3])
def test_partial_submit(fault, workdir: Path, single_submit: bool, overlap: bool, par: int) -> None:
    """When every submit accepts one op, the rest are resubmitted and everything completes correctly."""
    h = fault("partial_submit", qd=16, single_submit=single_submit, overlap=overlap, par=par)
    path = workdir / "f"
    src, data = aligned(h, 64)
    assert bounded(lambda: h.sync_pwrite(src, str(path))) == 1
    assert path.read_bytes() == data
    dst = torch.zeros(len(data) + 1, dtype=torch.uint8)[1:]
    assert h.async_pread(dst, str(path)) == 0
    assert h.async_pread(src, str(path)) == 0
    assert bounded(h.wait) == 2
    assert tbytes(dst) == data and tbytes(src) == data


@pytest.mark.parametrize("n", [1, 2, 5])
def test_eagain_submit_retried(fault, workdir: Path, n: int) -> None:
    """A submit refused once with EAGAIN is retried transparently."""
    h = fault(f"eagain_submit@{n}", qd=2)
    path = workdir / "f"
    src, data = aligned(h, 16)
    assert bounded(lambda: h.sync_pwrite(src, str(path))) == 1
    src.zero_()
    assert bounded(lambda: h.sync_pread(src, str(path))) == 1
    assert tbytes(src) == data


def test_combined_rules(fault, workdir: Path) -> None:
    """Several comma-separated rules apply together; the recoverable ones do not mask the fatal one."""
    h = fault("partial_submit,short@2,eagain_submit@1,eio@7", qd=8, overlap=True)
    path = workdir / "f"
    src, data = aligned(h, 4)
    assert bounded(lambda: h.sync_pwrite(src, str(path))) == 1
    assert path.read_bytes() == data
    with pytest.raises(OSError) as exc:
        bounded(lambda: h.sync_pread(src, str(path)))
    assert exc.value.errno == errno.EIO
    check_usable(h, workdir)


def test_async_error_surfaces_after_all_finish(fault, workdir: Path) -> None:
    """A failed async request makes the wait() raise only after the others completed correctly."""
    h = fault("eio@6", qd=2, overlap=True)
    paths, refs, bufs = [], [], []
    for i in range(3):
        p = workdir / f"r{i}"
        data = os.urandom(4 * BLOCK)
        p.write_bytes(data)
        paths.append(str(p))
        refs.append(data)
        bufs.append(h.new_cpu_locked_tensor(4 * BLOCK, U8))
    for b, p in zip(bufs, paths):
        assert h.async_pread(b, p) == 0
    with pytest.raises(OSError) as exc:
        bounded(h.wait)
    assert exc.value.errno == errno.EIO
    assert exc.value.filename in paths
    failed = paths.index(exc.value.filename)
    for i in range(3):
        if i != failed:
            assert tbytes(bufs[i]) == refs[i], i
    check_usable(h, workdir)


def test_sync_call_leaves_earlier_async_failure_to_wait(fault, workdir: Path) -> None:
    """A sync call raises only its own error: an earlier async request's failure stays pending and the next
    wait() raises it; then nothing stays pending."""
    h = fault("eio@1")
    path = workdir / "f"
    src, data = aligned(h, 2)
    path.write_bytes(data)
    assert h.async_pread(src, str(path)) == 0
    other = h.new_cpu_locked_tensor(len(data), U8)
    assert bounded(lambda: h.sync_pread(other, str(path))) == 1
    assert tbytes(other) == data
    with pytest.raises(OSError) as exc:
        bounded(h.wait)
    assert exc.value.errno == errno.EIO and exc.value.filename == str(path)
    check_usable(h, workdir)


@pytest.mark.parametrize("rules", ["bogus", "eio@", "eio@0", "eio@x", "short@-1", "hold@1"])
def test_bad_rules_rejected(aio_module: ModuleType, monkeypatch: pytest.MonkeyPatch, rules: str) -> None:
    """Malformed DEEPNVME_FAULT rules (and hold@N without $DEEPNVME_FAULT_GATE) are refused at construction
    rather than silently ignored."""
    monkeypatch.delenv("DEEPNVME_FAULT_GATE", raising=False)
    monkeypatch.setenv("DEEPNVME_FAULT", rules)
    with pytest.raises((ValueError, RuntimeError)):
        aio_module.aio_handle(engine="fault")


def test_hold_until_the_gate_opens(fault, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hold@N announces block N (held.N in the gate directory) and finishes it, other rules included, once
    the test creates go.N; a gate that cannot announce the block fails it with the errno, never hangs."""
    gate = workdir / "gate"
    gate.mkdir()
    monkeypatch.setenv("DEEPNVME_FAULT_GATE", str(gate))
    h = fault("hold@2,eio@3", qd=1)
    src, data = aligned(h, 3)
    assert h.async_pwrite(src, str(workdir / "f")) == 0
    wait_until(lambda: (gate / "held.2").exists(), "block 2 held")
    assert not (gate / "held.3").exists()  # qd=1: block 3 waits behind the held one
    (gate / "go.2").touch()
    with pytest.raises(OSError) as exc:
        h.wait()
    assert exc.value.errno == errno.EIO
    monkeypatch.setenv("DEEPNVME_FAULT_GATE", str(workdir / "missing"))
    h = fault("hold@1")
    with pytest.raises(OSError) as exc:
        bounded(lambda: h.sync_pwrite(src, str(workdir / "g")), timeout=30)
    assert exc.value.errno == errno.ENOENT
    check_usable(h, workdir)


@pytest.mark.parametrize("rule", ["eio@5", "enospc@9", "zero@2"])
@pytest.mark.parametrize("par", [2, 3])
def test_fault_with_parallel_workers(fault, workdir: Path, rule: str, par: int) -> None:
    """With P workers, one failing block still fails the request once, after all workers finished."""
    h = fault(rule, qd=4, overlap=True, par=par)
    path = workdir / "f"
    src, data = aligned(h, 12)
    path.write_bytes(data)
    expect = errno.ENOSPC if rule.startswith("enospc") else errno.EIO
    with pytest.raises(OSError) as exc:
        bounded(lambda: h.sync_pwrite(src, str(path)))
    assert exc.value.errno == expect and exc.value.filename == str(path)
    check_usable(h, workdir)


def o_direct_works(directory: Path) -> bool:
    """Whether the file system under directory accepts O_DIRECT (the remainder path needs it)."""
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.mark.parametrize("kind", ["read", "write"])
@pytest.mark.parametrize("memory", ["locked", "plain_misaligned"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_unaligned_short_remainder_is_buffered(fault, workdir: Path, kind: str, memory: str, n: int,
                                               overlap: bool) -> None:
    """An O_DIRECT block reported short by an odd count (the rest poisoned) is finished by the buffered
    remainder path: the rest lands at the right place in the right buffer (the tensor, or the staging buffer
    of a misaligned plain tensor), the request succeeds once, and every other byte is untouched."""
    if not o_direct_works(workdir):
        pytest.skip(f"{workdir} refuses O_DIRECT: the remainder path is for O_DIRECT transfers only")
    h = fault(f"unaligned_short@{n}", overlap=overlap)
    path = workdir / "f"
    nblocks = 4
    data = os.urandom(nblocks * BLOCK)
    if memory == "locked":
        buf = h.new_cpu_locked_tensor(len(data), U8)
    else:
        buf = torch.empty(len(data) + 1, dtype=torch.uint8)[1:]  # off the page: staged through the arena
    before = os.urandom(BLOCK)  # a neighbour block ahead of the request that must stay as it is
    if kind == "read":
        path.write_bytes(before + data)
        buf.fill_(0x11)
        assert bounded(lambda: h.sync_pread(buf, str(path), BLOCK)) == 1
        assert tbytes(buf) == data
    else:
        path.write_bytes(before)
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        assert bounded(lambda: h.sync_pwrite(buf, str(path), BLOCK)) == 1
        assert path.read_bytes() == before + data
        assert tbytes(buf) == data  # the source was only read
    assert h.wait() == 0
    check_usable(h, workdir)


def test_staged_io_survives_many_failed_staged_requests(fault, aio_module: ModuleType, workdir: Path) -> None:
    """Staging buffers come back on the error path: after 96 failed staged requests, each holding several
    buffers of the process-wide arena when it fails (more in all than its 128), staged I/O still completes."""
    path = workdir / "f"
    # Staged operations are at least one staging buffer (1 MiB) long: 4 MiB makes every request several of
    # them, so that each rule's operation exists and a request holds several buffers when it fails.
    nblocks = 1024
    data = os.urandom(nblocks * BLOCK)
    path.write_bytes(data)
    src = torch.empty(len(data) + 1, dtype=torch.uint8)[1:]  # misaligned: every block goes through staging
    src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    rules = ["eio@3", "enospc@2", "zero@4", "eio@1"]
    for i in range(96):
        rule = rules[i % len(rules)]
        h = fault(rule, qd=8, overlap=bool(i % 2), par=1 + i % 2)
        write = i % 3 != 0 or rule.startswith("enospc")
        with pytest.raises(OSError):
            bounded(lambda h=h, write=write: h.sync_pwrite(src, str(path)) if write else
                    h.sync_pread(src, str(path)), timeout=10)
        del h
    src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    h = aio_module.aio_handle(BLOCK, 8, False, True, 2, engine="posix")
    assert bounded(lambda: h.sync_pwrite(src, str(path)), timeout=10) == 1
    dst = torch.zeros(len(data) + 3, dtype=torch.uint8)[3:]
    assert bounded(lambda: h.sync_pread(dst, str(path)), timeout=10) == 1
    assert tbytes(dst) == data
