"""Child memory cgroups of the v1 hierarchy, for tests that hold a process to a budget (its page cache and
locked memory counted): made under the test process's own memory group, removed after."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def own_group() -> Path:
    """The memory cgroup this process is in (the hierarchy's root when it is in none of its own)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1 / path.lstrip("/")
    return CGROUP_V1


@contextlib.contextmanager
def memory_cgroup(name: str, limit: int | None = None) -> Iterator[Path]:
    """A new child memory cgroup `name` (with `limit` bytes, swapping off: over the limit means killed);
    skips the test where there is no v1 memory hierarchy or it cannot be made. Removed after, once the
    processes in it have gone."""
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    path = own_group() / name
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup in {path.parent}: {exc}")
    try:
        try:
            if limit is not None:
                (path / "memory.limit_in_bytes").write_text(str(limit))
            if (path / "memory.swappiness").exists():
                (path / "memory.swappiness").write_text("0")
        except OSError as exc:
            pytest.skip(f"cannot set the memory limit of {path}: {exc}")
        yield path
    finally:
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def argv_in(cgroup: Path, argv: list[str]) -> list[str]:
    """A command line that runs `argv` inside `cgroup` from its first instruction (the shell joins the
    group, then becomes the program): everything the process allocates is counted."""
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *argv]
