"""Why a measured figure may not be the drive's own: the disk is virtual and its host may cache it, or other
work is running on the CPUs. The demo prints these beside its figures, so that a reader knows when to doubt
them; each check reads only /sys and /proc and costs nothing measurable."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CpuClock", "virtual_disk"]

# Vendor and model strings of the disks hypervisors and clouds present (QEMU, VMware, VirtualBox, Hyper-V,
# Xen, AWS EBS, Google Persistent Disk): the host decides how such a disk is cached.
_VIRTUAL_NAMES = ("qemu", "vmware", "vbox", "virtual", "msft", "xen", "amazon elastic block store", "google")
# The id virtio devices report as their vendor (Red Hat's PCI id).
_VIRTIO_VENDOR = "0x1af4"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _disks_under(device: Path, depth: int = 0) -> list[Path]:
    """The whole-disk sysfs folders behind a block device: through a partition to its disk, and through
    device-mapper, RAID or other stacked devices to the devices they are built on."""
    device = device.resolve()
    if (device / "partition").exists():
        device = device.parent
    slaves = sorted((device / "slaves").iterdir()) if (device / "slaves").is_dir() else []
    if not slaves or depth > 8:
        return [device]
    return [disk for s in slaves for disk in _disks_under(s, depth + 1)]


def virtual_disk(path: str | os.PathLike[str]) -> str:
    """Why the disk holding `path` is not a drive the figures describe ('' when nothing says so): a virtio
    or other hypervisor's disk (its host may serve "cold" reads from its own cache), a loop device (a file on
    another file system, with that one's cache), a RAM or network disk."""
    st = os.stat(path)
    sysfs = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not sysfs.exists():
        return ""  # no block device (tmpfs, overlay, NFS...): read_mode() and the other checks speak for it
    for disk in _disks_under(sysfs):
        name = disk.name
        vendor, model = _read(disk / "device" / "vendor"), _read(disk / "device" / "model")
        if "/virtio" in str(disk) or vendor == _VIRTIO_VENDOR:
            return f"{name} is a virtio disk: its host may cache it, and serve reads from memory"
        label = f"{vendor} {model}".strip()
        if any(v in label.lower() for v in _VIRTUAL_NAMES) or name.startswith("xvd"):
            return f"{name} is a virtual disk ({label or 'Xen'}): its host may cache it"
        if name.startswith("loop"):
            return f"{name} is a loop device: a file on another file system, cached by that one"
        if name.startswith(("zram", "ram", "pmem")):
            return f"{name} is memory, not a drive"
        if name.startswith(("nbd", "rbd")):
            return f"{name} is a network block device"
    return ""


class CpuClock:
    """CPU time spent by everything on the machine, from /proc/stat: busy_cpus() says how many CPUs were
    busy since the last call, on average. Sampled while the demo rests, it measures other work."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except (OSError, IndexError):
            return (0, 0)
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle = ticks[3] + ticks[4]
        return (sum(ticks) - idle, sum(ticks))

    def busy_cpus(self) -> float:
        """Average number of busy CPUs since the previous call (or construction); 0.0 when unknown."""
        now = self._read()
        busy, total = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return (os.cpu_count() or 1) * busy / total if total > 0 else 0.0
