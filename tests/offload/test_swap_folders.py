"""Swap folders shared by processes that cannot see each other's pids (containers on one host: each its own
PID namespace): the owner is known by the lock it holds, so a live owner's folder is never taken for stale,
and a dead one's is removed. Real namespaces (`unshare --pid`), real processes, real flock."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from builder_helpers import REPO_ROOT
from thread_helpers import wait_until

from deepnvme.offload import SwapSpace
from deepnvme.offload.swap import folders
from op_builder.liveness import OWNER_LOCK, lock_held
from tests.offload.helpers import in_forked_child

CHILD = textwrap.dedent("""
    import os, sys, time
    from deepnvme.offload import SwapSpace
    space = SwapSpace(sys.argv[1], 1 << 20)
    space.add("u", 4096)
    open(sys.argv[2], "w").write(space.path)
    time.sleep(600)
""")


def _start_in_own_pid_namespace(tmp_path: Path, where: Path) -> tuple[subprocess.Popen, Path]:
    """A process in a PID namespace of its own (pid 1 there) holding a swap space in `where`; returns it and
    its space's folder. Skips where the kernel or the sandbox refuses the namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                           check=False)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid refused here: {probe.stderr.decode().strip()}")
    script, ready = tmp_path / "child.py", tmp_path / "ready"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [unshare, "--pid", "--fork", "--mount-proc", sys.executable, str(script), str(where), str(ready)]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    wait_until(lambda: ready.exists() and ready.read_text() != "" or proc.poll() is not None,
               "the namespaced process's swap space", 120)
    assert proc.poll() is None, "the namespaced process exited"
    folder = Path(ready.read_text()).parent
    return proc, folder


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_a_live_owner_in_another_pid_namespace_is_kept(tmp_path: Path, workdir: Path) -> None:
    """Its folder's name holds pid 1 (its namespace's), which here names init, started at another time: the
    pid rule would call it dead and delete a live process's swap file. The lock says it lives; once it is
    killed, the next space removes its folder."""
    proc, folder = _start_in_own_pid_namespace(tmp_path, workdir)
    try:
        assert folder.name.startswith(f"{folders.PREFIX}{folders.HOST}-1-"), folder.name
        assert (folder / OWNER_LOCK).exists()
        with SwapSpace(workdir, 1 << 20) as space:
            assert folder.exists() and (folder / "space-0" / "swap.bin").exists()
            assert Path(space.path).parent != folder
    finally:
        _stop(proc)
    assert folder.exists()  # nothing removes it until the next space is made there
    wait_until(lambda: lock_held(str(folder)) is False, "the namespaced process's end (its lock dropped)")
    with SwapSpace(workdir, 1 << 20):
        assert not folder.exists()
    assert os.listdir(workdir) == []


def test_own_folder_holds_its_lock_until_the_last_space_closes(workdir: Path) -> None:
    first = SwapSpace(workdir, 1 << 20)
    second = SwapSpace(workdir, 1 << 20)
    own = Path(first.path).parent
    assert Path(second.path).parent == own and (own / OWNER_LOCK).exists()
    assert not folders.is_stale(str(workdir), own.name)
    first.close()
    assert own.exists() and not folders.is_stale(str(workdir), own.name)
    second.close()
    assert not own.exists() and os.listdir(workdir) == []


def test_a_folder_whose_lock_nobody_holds_is_stale(workdir: Path) -> None:
    """A lock file that nobody holds (its owner died): stale, whatever its name says (even this process's
    pid and start time); a folder being made whose maker died likewise."""
    dead = workdir / folders.own_name()
    (dead / "space-0").mkdir(parents=True)
    (dead / OWNER_LOCK).write_bytes(b"")
    making = workdir / f"{folders.own_name()}.0123abcd.making"
    making.mkdir()
    (making / OWNER_LOCK).write_bytes(b"")
    assert folders.is_stale(str(workdir), dead.name) and folders.is_stale(str(workdir), making.name)
    with SwapSpace(workdir, 1 << 20) as space:
        assert not making.exists()
        assert Path(space.path).parent.name == dead.name  # the stale one is gone, its name free again
    assert os.listdir(workdir) == []


def test_a_forked_child_makes_its_own_folder_and_leaves_the_parents_lock(workdir: Path) -> None:
    with SwapSpace(workdir, 1 << 20) as space:
        own = Path(space.path).parent

        def child() -> None:
            with SwapSpace(workdir, 1 << 20) as mine:
                if Path(mine.path).parent == own:
                    raise AssertionError("the child used its parent's folder")

        assert in_forked_child(child) == "ok"
        assert own.exists() and not folders.is_stale(str(workdir), own.name)
    assert os.listdir(workdir) == []


def test_a_folder_being_made_is_kept_until_its_maker_is_surely_gone(workdir: Path) -> None:
    """A `.making` folder without a lock file yet (its maker between mkdir and locking) is kept for a
    minute, then taken for the leftover of a maker that died there."""
    young = workdir / f"{folders.own_name()}.0123abcd.making"
    old = workdir / f"{folders.own_name()}.89abcdef.making"
    young.mkdir()
    old.mkdir()
    os.utime(old, (os.stat(old).st_atime, os.stat(old).st_mtime - 120))
    assert not folders.is_stale(str(workdir), young.name) and folders.is_stale(str(workdir), old.name)
    with SwapSpace(workdir, 1 << 20):
        assert young.exists() and not old.exists()
    young.rmdir()
