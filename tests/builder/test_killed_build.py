"""A JIT build killed while torch's lock file exists costs the next load one rebuild, in the normal folder,
without a warning: the lock file it left is stale (no live process holds it) and is cleared under deepnvme's
own lock. The build is held inside the compiler by a wrapper that says when it is there, so the kill lands
while torch's lock exists without racing a timer against the build."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builder_helpers import _REPORT, _SPY, REPO_ROOT, load_script, run_python, tiny_build_dir, write_plugin

pytest.importorskip("torch")

LOAD = load_script("tiny_killed")

# A C++ compiler that stops (until killed, at most 5 minutes) on the plugin's source, after writing its pid
# as the mark; any other call (torch's compiler checks, the probes) goes to the real compiler.
WRAPPER = """#!/bin/sh
for a in "$@"; do
  case "$a" in *tiny.cpp) echo $$ > "{mark}.tmp"; mv "{mark}.tmp" "{mark}"; exec sleep 300;; esac
done
exec c++ "$@"
"""


def test_a_killed_build_costs_one_rebuild_in_the_normal_folder(tmp_path):
    write_plugin(tmp_path, name="tiny_killed")
    ext, mark = tmp_path / "ext", tmp_path / "compiling"
    wrapper = tmp_path / "cxx-wrapper"
    wrapper.write_text(WRAPPER.format(mark=mark))
    wrapper.chmod(0o755)
    build_dir = tiny_build_dir(ext, tmp_path, "tiny_killed")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "CXX": str(wrapper),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    child = subprocess.Popen([sys.executable, "-c", _SPY + LOAD + _REPORT], env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Waits on the compiler's mark (an event), not on a guess at how long the build takes; the deadline
        # only stops a broken setup from hanging the run.
        deadline = time.monotonic() + 240
        while not mark.exists():
            if child.poll() is not None:
                err = child.communicate()[1]
                pytest.fail(f"the build ended before reaching the compiler:\n{err[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the build did not reach the compiler within 240 s")
            time.sleep(0.05)
        assert (build_dir / "lock").exists()  # torch's lock, held by the build
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the load and ninja
        child.communicate(timeout=60)
        # ninja runs each command in a process group of its own: the held compiler is ended by its pid.
        if mark.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(mark.read_text()), signal.SIGKILL)
    assert (build_dir / "lock").exists()  # what a killed build leaves behind

    again = run_python(LOAD, paths=[tmp_path], env={"TORCH_EXTENSIONS_DIR": str(ext)})
    assert again["result"]["value"] == 1
    assert Path(again["result"]["file"]).parent == build_dir
    assert not (build_dir / "lock").exists() and not (build_dir / "retry-1").exists()
    builds = [c for c in again["calls"] if "ninja" in c and "--version" not in c]
    assert len(builds) == 1, again["calls"]
    assert "Warning" not in again["stderr"], again["stderr"]
    assert again["result"]["warm_miss"].startswith("no stamp")

    warm = run_python(LOAD, paths=[tmp_path], env={"TORCH_EXTENSIONS_DIR": str(ext)})
    assert warm["calls"] == [] and warm["result"]["warm_miss"] is None
    assert warm["result"]["file"] == again["result"]["file"]
