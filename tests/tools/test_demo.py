"""The demo (deepnvme demo) on real small runs: the table of medians and ranges for both
contenders, the verdict, and the warnings it must give when the figures are not the drive's (a busy CPU,
made here by busy-loop processes; a directory in memory, whose page cache cannot be dropped)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepnvme.filesystem import mount_of
from deepnvme.tools.trust import virtual_disk

REPO_ROOT = Path(__file__).resolve().parents[2]
RATE = r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)"  # median (min-max)


def demo(*args: str) -> subprocess.CompletedProcess:
    """Run the demo as a user would, in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "deepnvme", "demo", *args], capture_output=True, text=True,
                          env=env, timeout=240, check=False)


def warnings_of(out: str) -> list[str]:
    return [line[len("warning: "):] for line in out.splitlines() if line.startswith("warning: ")]


@pytest.fixture
def busy_cpus() -> Iterator[int]:
    """One busy-loop process per CPU, for the length of the test."""
    n = os.cpu_count() or 1
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield n
    finally:
        for p in loops:
            p.kill()
            p.wait()


def test_table_verdict_and_cleanup(workdir: Path) -> None:
    """Two repeats of each contender: medians and ranges, speed-ups with their range, verified data, either
    a verdict of trust or warnings, and no file left behind."""
    r = demo("--size", "8M", "--dir", str(workdir), "--repeats", "2", "--rest", "0.1")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "repeats: 2, interleaved, 0.1 s rest before each step" in out
    assert re.search(rf"^deepnvme aio_handle\s+{RATE}\s+{RATE}$", out, re.M), out
    assert re.search(rf"^torch\.save / torch\.load\s+{RATE}\s+{RATE}$", out, re.M), out
    assert re.search(r"^speed-up\s+\d+\.\dx\s+\d+\.\dx$", out, re.M), out
    assert re.search(r"^  range over the repeats\s+\d+\.\d-\d+\.\dx\s+\d+\.\d-\d+\.\dx$", out, re.M), out
    assert "data verified: identical" in out
    doubts = warnings_of(out)
    assert bool(doubts) == ("these figures may not be the drive's:" in out)
    assert bool(doubts) != out.rstrip().splitlines()[-1].startswith("trust: ")
    assert any(d.startswith("virtual disk: ") for d in doubts) == bool(virtual_disk(workdir)), doubts
    assert list(workdir.iterdir()) == []


def test_busy_cpu_is_reported(workdir: Path, busy_cpus: int) -> None:
    """With every CPU taken by a busy loop, the demo says the CPUs were busy while it rested."""
    r = demo("--size", "4M", "--dir", str(workdir), "--repeats", "2", "--rest", "0.3")
    assert r.returncode == 0, r.stdout + r.stderr
    busy = [d for d in warnings_of(r.stdout) if d.startswith("busy CPU: ")]
    assert busy, r.stdout
    assert f"of {busy_cpus} CPUs busy while the demo rested" in busy[0]


def test_page_cache_in_memory_is_reported() -> None:
    """In tmpfs nothing is read from a drive and the file's pages cannot be dropped: both are said."""
    shm = Path("/dev/shm")
    if mount_of(shm)[1] != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    r = demo("--size", "4M", "--dir", str(shm), "--repeats", "1", "--rest", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    doubts = warnings_of(r.stdout)
    assert any(d.startswith("page cache: /dev/shm is in memory") for d in doubts), r.stdout
    assert any(d.startswith("page cache could not be dropped (") for d in doubts), r.stdout


@pytest.mark.parametrize("args,complaint", [(["--repeats", "0"], "--repeats"), (["--rest", "-1"], "--rest"),
                                            (["--size", "0"], "--size")])
def test_bad_arguments(args: list[str], complaint: str) -> None:
    r = demo(*args)
    assert r.returncode == 2 and f"argument {complaint}" in r.stderr, r.stderr
