"""op_builder.liveness: the one rule for "does the process that left this behind still run?" (pid and start
time), as the atomic replace's stale-temporary cleanup and the swap space's folders apply it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from op_builder.atomic_file import _HOST, TEMP_SUFFIX, remove_stale_temps, replace_bytes
from op_builder.liveness import owner_alive, owner_mark, parse_owner_mark, start_time


@pytest.fixture
def live() -> Iterator[subprocess.Popen]:
    """Another process, running for the test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


def test_marks_name_a_process_by_pid_and_start_time(live: subprocess.Popen) -> None:
    start = start_time(live.pid)
    assert start and owner_mark(live.pid) == f"{live.pid}-{start}"
    assert parse_owner_mark(owner_mark(live.pid)) == (live.pid, start)
    assert parse_owner_mark(str(live.pid)) == (live.pid, None)  # a name written before start times
    for bad in ("", "x", "12-", "-3", "1-2-3", "12-ab"):
        assert parse_owner_mark(bad) is None, bad


def test_alive_means_that_pid_started_at_that_time(live: subprocess.Popen) -> None:
    start = start_time(live.pid)
    assert owner_alive(live.pid, start) and owner_alive(*parse_owner_mark(owner_mark()))
    assert not owner_alive(live.pid, start + 1)  # the pid reused by another process
    assert owner_alive(live.pid, None)  # a bare pid says no more than "that pid runs"
    assert not owner_alive(_dead_pid(), None)


def test_stale_temporaries_go_by_the_same_rule(tmp_path: Path, live: subprocess.Popen) -> None:
    """A replace removes the temporaries of dead owners, a pid reused by another process included, and
    keeps those of running ones (this process's too)."""
    def temp(mark: str) -> Path:
        path = tmp_path / f".f.bin.{_HOST}.{mark}.0badf00d{TEMP_SUFFIX}"
        path.write_bytes(b"x")
        return path

    start = start_time(live.pid)
    kept = [temp(owner_mark(live.pid)), temp(str(live.pid)), temp(owner_mark())]
    gone = [temp(f"{live.pid}-{start + 1}"), temp(f"{_dead_pid()}-1"), temp(str(_dead_pid()))]
    replace_bytes(str(tmp_path / "f.bin"), b"new")
    assert all(p.exists() for p in kept) and not any(p.exists() for p in gone)
    remove_stale_temps(str(tmp_path), "f.bin")
    assert all(p.exists() for p in kept)


def test_the_swap_folders_use_the_same_marks(tmp_path: Path) -> None:
    """Swap folders without an owner lock (left by a version that did not lock) fall back to this rule."""
    from deepnvme.offload.swap import folders as swapdir

    assert swapdir.own_name().endswith(f"-{owner_mark()}")
    assert not swapdir.is_stale(str(tmp_path), swapdir.own_name())
    pid, start = parse_owner_mark(owner_mark())
    assert swapdir.is_stale(str(tmp_path), swapdir.own_name().replace(f"-{start}", f"-{start + 1}"))
    assert os.getpid() == pid
