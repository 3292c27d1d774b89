"""deepnvme.save is atomic: kill -9 at any moment and a full file system never spoil the last checkpoint."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import deepnvme
from deepnvme.serialization import TEMP_SUFFIX

REPO = Path(__file__).resolve().parents[2]

# The child saves checkpoint 1, 2, 3, ... to one path, alternating a long and a short one, and reports each
# after save() returned. Checkpoint i is fully determined by i, so the parent can rebuild it.
CHILD = r"""
import sys, torch, deepnvme
sys.path.insert(0, {repo!r})
from tests.checkpoint.test_serialization_atomic import checkpoint
path = sys.argv[1]
i = 0
while True:
    i += 1
    deepnvme.save(checkpoint(i), path)
    print(i, flush=True)
"""


def checkpoint(i: int) -> dict:
    """Checkpoint number i: odd ones ~3 MB, even ones ~0.3 MB, contents seeded by i."""
    g = torch.Generator().manual_seed(i)
    n = 750_000 if i % 2 else 75_000
    return {"i": i, "w": torch.randn(n, generator=g), "b": torch.randint(0, 9, (1000 + i,), generator=g)}


def _equal(a: dict, b: dict) -> bool:
    return a["i"] == b["i"] and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


def _stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped: kill() returns before a thread running on another CPU, or
    inside a system call (a rename, an fsync), has stopped, and until then it may still change the folder."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that has just ended
            continue
    return all(state in ("T", "t") for state in states)


def _stop_inside_a_save(child: subprocess.Popen, folder: Path, rng: random.Random) -> None:
    """Freeze the child (SIGSTOP) at random moments until one finds it inside save(): its temporary exists."""
    from thread_helpers import wait_until  # here: the child imports this module without tests/support

    for _ in range(500):
        time.sleep(rng.uniform(0.0, 0.03))
        child.send_signal(signal.SIGSTOP)
        wait_until(lambda: _stopped(child.pid), "the child stopped by SIGSTOP")
        if any(p.name.endswith(TEMP_SUFFIX) for p in folder.iterdir()):
            return
        child.send_signal(signal.SIGCONT)
    raise AssertionError("never caught the child inside a save")


@pytest.mark.parametrize("seed,moment", [(1, "any"), (2, "any"), (3, "inside a save"), (4, "inside a save")])
def test_kill_9_at_a_random_moment_leaves_the_previous_or_the_new_checkpoint(tmp_path: Path, seed: int,
                                                                            moment: str) -> None:
    """SIGKILL at a random time, or at a random time known to fall inside save() (temporary present)."""
    path = tmp_path / "ckpt.pt"
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=str(REPO)), str(path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = child.stdout.readline()  # one checkpoint is complete: from here on there is a previous one
        assert first.strip() == "1", child.stderr.read()
        if moment == "any":
            time.sleep(rng.uniform(0.0, 0.6))
        else:
            _stop_inside_a_save(child, tmp_path, rng)
    finally:
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=60)
    reported = int(([first] + rest.split())[-1])
    left = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    if moment != "any":
        assert len(left) == 1 and left[0].endswith(TEMP_SUFFIX)
    got = deepnvme.load(path, weights_only=False)
    # Killed after save() returned but before the report, or during the next save: either is fine.
    assert got["i"] in (reported, reported + 1)
    assert _equal(got, checkpoint(got["i"]))
    deepnvme.save(checkpoint(99), path)  # a successful save clears the dead child's temporaries
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert _equal(deepnvme.load(path, weights_only=False), checkpoint(99))


def test_stale_temporary_of_a_live_process_is_left_alone(tmp_path: Path) -> None:
    """Another live process may be saving the same name: its temporary must survive our save."""
    from op_builder.atomic_file import _HOST

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # killed below
    try:
        theirs = tmp_path / f".c.pt.{_HOST}.{live.pid}.abcd{TEMP_SUFFIX}"
        theirs.write_bytes(b"in progress")
        deepnvme.save({"w": torch.ones(3)}, tmp_path / "c.pt")
        assert theirs.exists()
    finally:
        live.kill()
        live.wait()
    deepnvme.save({"w": torch.ones(3)}, tmp_path / "c.pt")
    assert not theirs.exists()


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(params=["ext4 on a loop device", "tmpfs"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted 16 MiB file system (root and mount permission needed; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    if request.param == "tmpfs":
        done = _run("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt))
    else:
        if not shutil.which("mkfs.ext4"):
            pytest.skip("mkfs.ext4 is not installed")
        image = tmp_path / "fs.img"
        with open(image, "wb") as f:
            f.truncate(16 << 20)
        made = _run("mkfs.ext4", "-q", "-F", str(image))
        if made.returncode:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        done = _run("mount", "-o", "loop", str(image), str(mnt))
    if done.returncode:
        pytest.skip(f"cannot mount a {request.param} here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        _run("umount", str(mnt))


def test_full_file_system_raises_enospc_and_keeps_the_previous_checkpoint(small_fs: Path) -> None:
    path = small_fs / "ckpt.pt"
    before = checkpoint(2)
    deepnvme.save(before, path)
    too_big = {"i": 3, "w": torch.randn(6 << 20)}  # 24 MiB on a 16 MiB file system
    with pytest.raises(OSError) as caught:
        deepnvme.save(too_big, path)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert [p.name for p in small_fs.iterdir() if p.name != "lost+found"] == ["ckpt.pt"]
    assert _equal(deepnvme.load(path, weights_only=False), before)
    deepnvme.save(checkpoint(4), path)  # the space is free again
    assert _equal(deepnvme.load(path, weights_only=False), checkpoint(4))
