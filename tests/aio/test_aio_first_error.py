"""Which error a wait() raises when several of the requests it covers fail: the first one submitted (the
lowest request id, pipeline.h's first_failure), whatever order they failed in; within one request, the first
failure in time (PendingRequest::fail). The fault engine's hold@N sets the order of failures, not timing."""

from __future__ import annotations

import errno
from pathlib import Path
from types import ModuleType

import pytest
import torch
from thread_helpers import wait_until

BLOCK = 4096
U8 = torch.empty(0, dtype=torch.uint8)


def fault_handle(aio_module: ModuleType, monkeypatch: pytest.MonkeyPatch, rules: str, gate: Path | None,
                 qd: int, par: int):
    """A fault-engine handle of one-block operations with these rules (and gate directory for hold@N)."""
    monkeypatch.setenv("DEEPNVME_FAULT", rules)
    if gate is not None:
        gate.mkdir()
        monkeypatch.setenv("DEEPNVME_FAULT_GATE", str(gate))
    return aio_module.aio_handle(BLOCK, qd, False, False, par, engine="fault")


def test_first_submitted_failure_wins(aio_module: ModuleType,
                                     monkeypatch: pytest.MonkeyPatch, workdir: Path) -> None:
    """Request A is submitted first and fails last; B, submitted after it, fails first: wait() raises A's
    EIO with A's path, not B's ENOSPC.

    Two workers, one operation in flight each, requests of one block. A goes to worker 0 and its block (1) is
    held; B goes to worker 1 and its block (2) fails at once; C queues behind A; D goes to worker 1 and its
    block (3), held, can only start after B's completion was handled. Then A's block is released and fails."""
    gate = workdir / "gate"
    h = fault_handle(aio_module, monkeypatch, "hold@1,eio@1,enospc@2,hold@3", gate, qd=1, par=2)
    bufs = [torch.full((BLOCK,), i, dtype=torch.uint8) for i in range(4)]
    paths = [str(workdir / name) for name in "ABCD"]
    assert h.async_pwrite(bufs[0], paths[0]) == 0
    wait_until(lambda: (gate / "held.1").exists(), "A's block held")
    for i in (1, 2, 3):
        assert h.async_pwrite(bufs[i], paths[i]) == 0
    wait_until(lambda: (gate / "held.3").exists(), "D's block held, so B has failed")
    (gate / "go.1").touch()
    (gate / "go.3").touch()
    with pytest.raises(OSError) as exc:
        h.wait()
    assert (exc.value.errno, exc.value.filename) == (errno.EIO, paths[0]), exc.value
    assert h.wait() == 0
    assert Path(paths[2]).read_bytes() == bytes([2]) * BLOCK  # C and D, not failed, were written
    assert Path(paths[3]).read_bytes() == bytes([3]) * BLOCK


def test_first_failure_in_time_wins_within_a_request(aio_module: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                     workdir: Path) -> None:
    """One request whose first block fails with EIO and second with ENOSPC (issued together, completed in
    that order): its error is the EIO."""
    h = fault_handle(aio_module, monkeypatch, "eio@1,enospc@2", None, qd=4, par=1)
    src = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    path = str(workdir / "f")
    assert h.async_pwrite(src, path) == 0
    with pytest.raises(OSError) as exc:
        h.wait()
    assert (exc.value.errno, exc.value.filename) == (errno.EIO, path), exc.value

