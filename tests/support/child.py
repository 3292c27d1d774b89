"""A test's script run in a fresh interpreter: for what could crash, hang or change process-wide state
(limits, signals, fork) and so must not run in pytest's own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from builder_helpers import REPO_ROOT


def run_in_child(workdir: Path, script: str, timeout: float) -> str:
    """Write `script` to `workdir`/child.py and run it with the repository importable and `workdir` as its
    argument; fail the test (AssertionError with its output) on a hang or a non-zero exit; give its stdout."""
    path = workdir / "child.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    try:
        r = subprocess.run([sys.executable, str(path), str(workdir)], env=env, capture_output=True,
                           text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"child hung (> {timeout} s); output so far:\n{e.stdout}\n{e.stderr}") from None
    assert r.returncode == 0, f"child exit status {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout
