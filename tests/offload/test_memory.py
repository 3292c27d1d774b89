"""Memory of the offloaded optimizer, measured in a child process (its RSS is not the test runner's).

- a step's peak resident growth stays within the budget plus a fixed overhead, for a state 8x the budget;
- locked memory is the budget, never more, at every tile;
- save() and load() of that state grow the peak RSS by no more than the budget plus the same overhead;
- over 200 small steps: no growth of RSS, descriptors or threads; nothing left after close.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BUDGET = 4 << 20
# Allocator and interpreter slack of a step beside the pool (the pool itself is resident before it starts).
OVERHEAD = 8 << 20
ROOT = Path(__file__).resolve().parents[2]


def _child(directory: Path, width: int, layers: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(directory), str(BUDGET), str(width), str(layers), str(steps)]
    done = subprocess.run([sys.executable, "-m", "tests.offload.memory_child", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_step_memory_within_budget_for_a_state_8x_larger(workdir: Path) -> None:
    r = _child(workdir, 512, 16, 3)  # 16 layers of 512x512: Adam's state is 32 MiB, 8x the budget
    assert r["state_bytes"] >= 8 * BUDGET
    assert r["peak_growth"] <= BUDGET + OVERHEAD, r
    assert r["locked_max"] <= BUDGET and r["peak_in_use"] <= BUDGET, r
    assert r["save_growth"] <= BUDGET + OVERHEAD and r["load_growth"] <= BUDGET + OVERHEAD, r
    assert r["locked_after"] == 0 and r["left"] == []


def test_no_growth_over_many_steps(workdir: Path) -> None:
    r = _child(workdir, 64, 4, 200)
    first, last = r["rss"]
    assert last - first <= 1 << 20, r
    assert r["fds"][0] == r["fds"][1] and r["threads"][0] == r["threads"][1], r
    assert r["left"] == [] and r["locked_after"] == 0
