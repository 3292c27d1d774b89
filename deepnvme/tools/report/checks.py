"""ds_report's own checks, in pure Python: O_DIRECT in a directory, the locked-memory limit, where torch puts
plain tensors, /dev/shm."""

from __future__ import annotations

import errno
import mmap
import os
import resource
import sys
import uuid

from deepnvme._core.direct import o_direct_refused
from deepnvme._core.memory import PAGE
from deepnvme._core.memory import has_cap_ipc_lock as _has_cap_ipc_lock  # a name the tests replace
from deepnvme.filesystem import mount_of

from .model import Finding

__all__ = ["MEMLOCK_WANTED", "O_DIRECT_BLOCK", "SHM_WANTED", "check_memlock", "check_o_direct",
           "check_moe_experts", "check_plain_tensors", "human_bytes", "iec", "shm_size"]

# One aligned block: a page suits both 512-byte and 4 KiB logical sectors, and an mmap buffer is page aligned.
O_DIRECT_BLOCK = PAGE
# Below this, one large pinned tensor or the staging pool cannot be locked; 1 GiB is a modest shard.
MEMLOCK_WANTED = 1 << 30
# DeepSpeed warns below this /dev/shm size because Docker's 64 MB default starves dataloaders and NCCL.
SHM_WANTED = 512 << 20


def human_bytes(n: float) -> str:
    """Format a byte count the way DeepSpeed's report does: 1024 base, two decimals, B..TB."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TB"


def iec(n: int) -> str:
    """Format a limit compactly (8 MiB, 1 GiB) for capability details."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or n % 1024:
            return f"{n} {unit}"
        n //= 1024
    return f"{n} TiB"


def check_o_direct(directory: str) -> Finding:
    """Create a file with O_DIRECT in directory, write and read back one aligned block, and remove it."""
    key, label = "o_direct", "O_DIRECT"
    _, fstype = mount_of(directory)
    where = f"{directory} ({fstype})" if fstype else directory
    fallback = (
        "deepnvme falls back to buffered I/O there: it works, but every byte goes through the page "
        "cache, which costs RAM and throughput"
    )
    fix = "point --dir, and the paths you read and write, at a local disk filesystem such as ext4 or xfs"
    if not hasattr(os, "O_DIRECT"):
        return Finding(key, label, False, "O_DIRECT is not defined on this platform", fallback, fix)
    path = os.path.join(directory, f".deepnvme-odirect-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        if o_direct_refused(exc):
            # Some filesystems (ramfs) create the file before refusing the flag; the name is ours (O_EXCL).
            _unlink_quietly(path)
            return Finding(
                key,
                label,
                False,
                f"refused on {where}",
                f"the filesystem rejects O_DIRECT (open gave {errno.errorcode[exc.errno]}); {fallback}",
                fix,
            )
        return Finding(
            key,
            label,
            False,
            f"could not test {directory}: {exc.strerror}",
            "a test file could not be created there",
            "pass --dir with a writable directory",
        )
    try:
        out = mmap.mmap(-1, O_DIRECT_BLOCK)
        back = mmap.mmap(-1, O_DIRECT_BLOCK)
        pattern = os.urandom(64) * (O_DIRECT_BLOCK // 64)
        out.write(pattern)
        try:
            written = os.pwrite(fd, out, 0)
            read = os.preadv(fd, [back], 0)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return Finding(
                    key,
                    label,
                    False,
                    f"open accepted O_DIRECT on {where} but a "
                    f"{O_DIRECT_BLOCK}-byte aligned transfer gave EINVAL",
                    f"the device needs a larger alignment than {O_DIRECT_BLOCK} bytes; {fallback}",
                    fix,
                )
            return Finding(
                key,
                label,
                False,
                f"I/O on {where} failed: {exc.strerror}",
                "the aligned test write or read failed",
                "check the device and free space",
            )
        if written != O_DIRECT_BLOCK or read != O_DIRECT_BLOCK or back[:] != pattern:
            return Finding(
                key,
                label,
                False,
                f"short or corrupt aligned transfer on {where}",
                f"wrote {written} and read {read} of {O_DIRECT_BLOCK} bytes",
                "check the device",
            )
        return Finding(
            key, label, True, f"supported on {where}: {O_DIRECT_BLOCK}-byte aligned write and read back"
        )
    finally:
        os.close(fd)
        _unlink_quietly(path)


def _unlink_quietly(path: str) -> None:
    """Remove the O_DIRECT test file; a file already gone is fine."""
    try:
        os.unlink(path)
    except OSError:
        pass


def check_memlock() -> Finding:
    """Report the locked-memory limit that bounds pinned tensors and the staging pool."""
    key, label = "memlock", "locked memory (RLIMIT_MEMLOCK)"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def show(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else iec(v)

    limits = f"soft {show(soft)}, hard {show(hard)}"
    if soft == resource.RLIM_INFINITY:
        return Finding(key, label, True, "unlimited")
    if _has_cap_ipc_lock():
        return Finding(key, label, True, f"{limits}; not enforced: this process has CAP_IPC_LOCK")
    if soft >= MEMLOCK_WANTED:
        return Finding(key, label, True, limits)
    return Finding(
        key,
        label,
        False,
        limits,
        f"pinned (page-locked) tensors and staging buffers can lock at most {show(soft)} in total; "
        "larger requests fail to lock",
        "raise it: `ulimit -l unlimited` (as root, or up to the hard limit), '* - memlock unlimited' "
        "in /etc/security/limits.conf, or `docker run --ulimit memlock=-1`",
    )


def check_plain_tensors() -> Finding:
    """Whether torch's allocator page-aligns large plain tensors: aligned ones go to O_DIRECT as they are,
    the others (by default torch puts them 64 bytes past a page) are copied through the staging pool.

    Measured on a 4 MiB tensor when torch is already imported; otherwise read from THP_MEM_ALLOC_ENABLE, the
    variable torch's CPU allocator reads once at start-up, so that the report need not import torch.
    """
    key, label = "plain_tensors", "plain tensors (torch.empty)"
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "empty"):
        residue = torch.empty(4 << 20, dtype=torch.uint8).data_ptr() % PAGE
        aligned, how = residue == 0, f"{residue} bytes past a page"
    else:
        aligned, how = os.environ.get("THP_MEM_ALLOC_ENABLE", "") == "1", "THP_MEM_ALLOC_ENABLE is not 1"
    if aligned:
        return Finding(key, label, True,
                       "page-aligned from 2 MiB up: moved in place (no copy) at aligned file offsets")
    return Finding(
        key,
        label,
        True,
        f"not page-aligned ({how}): O_DIRECT takes them through the staging pool",
        "each block of a plain tensor is copied (about 0.1 CPU-seconds per GiB); locked ones are not",
        "start Python with THP_MEM_ALLOC_ENABLE=1 (torch then page-aligns tensors of 2 MiB and more), or "
        "allocate with new_cpu_locked_tensor",
    )


def check_moe_experts() -> Finding:
    """How deepnvme.moe multiplies a layer's experts here (deepnvme.moe.grouped.choose, per device and
    dtype), and whether torch's grouped mm runs."""
    key, label = "moe_experts", "MoE experts"
    try:
        from deepnvme.moe.grouped import describe

        return Finding(key, label, True, describe())
    except Exception as exc:  # noqa: BLE001 - the report must still explain a broken install
        return Finding(key, label, False, "unknown", f"{type(exc).__name__}: {exc}",
                       "reinstall deepnvme with a working torch")


def shm_size() -> tuple[str, int | None]:
    """Size of /dev/shm, human readable and in bytes; ('UNKNOWN', None) when it cannot be read."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return "UNKNOWN", None
    size = st.f_frsize * st.f_blocks
    return human_bytes(size), size
