"""The memory the process's cgroup has left: what a configuration needs is checked against it up front,
since a cgroup's limit (containers, job schedulers) counts page cache and locked memory, and going over it
ends in the kernel's OOM killer, not in an exception."""

from __future__ import annotations

import os

# A limit at least this large means none (v1 writes PAGE_COUNTER_MAX pages as bytes, about 2^63).
UNLIMITED = 1 << 60
ROOT = "/sys/fs/cgroup"


def _read(folder: str, name: str) -> str | None:
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(folder: str) -> dict[str, int]:
    lines = (_read(folder, "memory.stat") or "").splitlines()
    return {k: int(v) for k, v in (ln.split() for ln in lines if len(ln.split()) == 2)}


def memory_room(proc_cgroup: str = "/proc/self/cgroup", root: str = ROOT) -> tuple[int, int, str] | None:
    """(limit, usage, cgroup folder) of this process's memory cgroup, v1 or v2: the limit the least along
    its ancestors (v1's hierarchical_memory_limit), the usage without inactive page cache (the kernel
    reclaims that before it kills); None without a limit or a readable cgroup."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v1 = "memory" in controllers.split(",")
        if not v1 and not line.startswith("0::"):
            continue
        folder = os.path.join(root, *(["memory"] if v1 else []), path.lstrip("/"))
        stat = _stat(folder)
        limit = (stat.get("hierarchical_memory_limit") or _read(folder, "memory.limit_in_bytes") if v1
                 else _read(folder, "memory.max"))
        usage = _read(folder, "memory.usage_in_bytes" if v1 else "memory.current")
        if limit in (None, "max") or usage is None or int(limit) >= UNLIMITED:  # type: ignore[arg-type]
            return None
        cache = stat.get("total_inactive_file" if v1 else "inactive_file", 0)
        return int(limit), max(0, int(usage) - cache), folder  # type: ignore[arg-type]
    return None


def memory_left() -> int | None:
    """Bytes this process may still take: the least of what its memory cgroup has left (where it has a
    limit) and the system's MemAvailable (the host can be tighter than the cgroup); None when neither can
    be read."""
    room = memory_room()
    left = [max(0, room[0] - room[1])] if room is not None else []
    try:
        with open("/proc/meminfo") as f:
            left += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    return min(left) if left else None


def check_memory_room(need: int, what: str) -> None:
    """Refuse, with the numbers, a configuration that needs `need` more bytes than the memory cgroup has
    left (MemoryError: the kernel would kill the process part way through instead)."""
    room = memory_room()
    if room is None:
        return
    limit, usage, folder = room
    if need > limit - usage:
        raise MemoryError(f"{what} needs {need} bytes of memory beyond what the process uses now, and its "
                          f"memory cgroup ({folder}) has {max(0, limit - usage)} left ({limit} limit, "
                          f"{usage} used): raise the cgroup's limit, or lower budget_bytes, or make "
                          "smaller units")


# glibc's mallopt parameter for the size from which allocations are mapped on their own (M_MMAP_THRESHOLD).
_M_MMAP_THRESHOLD = -3
# Tensors this large and up get memory of their own, given back to the system when freed.
MMAP_THRESHOLD = 4 << 20
_fixed = False


def return_freed_memory() -> bool:
    """Have glibc map allocations of MMAP_THRESHOLD bytes and up on their own (once per process; False
    where the C library is not glibc). Why: glibc raises its threshold each time a mapped block is freed,
    after which tensors of a unit's size come from the heap, and a heap keeps what is freed in it: training
    beyond memory, which frees a unit's gradients and optimizer state for the next unit's, would see its
    resident memory grow by hundreds of MiB over one step and be killed by a memory cgroup's limit. A fixed
    threshold ends the raising; the cost is a page fault per page of each such tensor when it is made."""
    global _fixed
    if _fixed:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        _fixed = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
    return _fixed
