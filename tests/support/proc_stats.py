"""What this process holds, as Linux counts it: for the tests that check nothing leaks (descriptors, locked
memory)."""

from __future__ import annotations

import os


def fd_count() -> int:
    """Open descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def vm_lck_kb() -> int:
    """Locked memory of this process in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck line")
