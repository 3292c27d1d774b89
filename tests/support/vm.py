"""What the kernel says about this process's mappings, for tests of memory the op makes."""

from __future__ import annotations

import resource
from pathlib import Path


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps): "um" marks pages registered with a
    userfaultfd in missing-page mode."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def faults() -> int:
    """Page faults of this process so far, minor and major: a fault a userfaultfd answers counts as major."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt
