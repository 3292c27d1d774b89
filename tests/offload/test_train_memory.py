"""Training beyond memory, held to it by a real memory cgroup (v1 here, page cache and locked memory
counted): parameters + gradients + AdamW state 4x the cgroup's limit train to the end inside it, where the
same training in memory is killed; a configuration the cgroup cannot hold is refused up front with the
numbers (issue 36)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cgroups import argv_in, memory_cgroup
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
LAYERS, WIDTH = 28, 2048  # 28 x 16 MiB: 448 MiB of fp32 parameters
LIMIT = 448 << 20
BUDGET = 48 << 20


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A child memory cgroup of the v1 hierarchy (removed after)."""
    with memory_cgroup(f"deepnvme-test-{os.getpid()}") as path:
        yield path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    torch.save(model.state_dict(), path)
    return path


def _run(cgroup: Path, limit: int, mode: str, checkpoint: Path, workdir: Path,
         budget: int = BUDGET) -> subprocess.CompletedProcess[str]:
    (cgroup / "memory.limit_in_bytes").write_text(str(limit))
    args = [sys.executable, "-m", "tests.offload.train_memory_child", mode, str(checkpoint), str(workdir),
            str(LAYERS), str(WIDTH), str(budget), "2"]
    return subprocess.run(argv_in(cgroup, args), capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def test_a_model_4x_the_memory_limit_trains_inside_it(cgroup: Path, checkpoint: Path, workdir: Path) -> None:
    params = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert params * 4 >= 4 * LIMIT  # parameters + gradients + AdamW's two moments
    done = _run(cgroup, LIMIT, "offload", checkpoint, workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    peak = int((cgroup / "memory.max_usage_in_bytes").read_text())
    print(f"\nparameters+gradients+state {4 * params >> 20} MiB in a {LIMIT >> 20} MiB cgroup: peak "
          f"{peak >> 20} MiB (cgroup), RSS {r['peak_rss'] >> 20} MiB, locked {r['locked'] >> 20} MiB, "
          f"{r['s_per_step']:.2f} s/step, needed up front {r['memory_bytes'] >> 20} MiB beyond the "
          f"interpreter")
    assert peak <= LIMIT and all(x == x for x in r["losses"])
    assert r["locked"] <= 2 * BUDGET
    # close() would put 448 MiB back in memory: refused with the numbers; close(restore=False) drops them
    assert r["close_refused"].startswith("close() of offload_parameters, putting the parameters back in "
                                         f"memory (or save() them and close(restore=False)) needs {params} "
                                         "bytes"), r["close_refused"]
    assert r["files_left"] == [], r["files_left"]  # the swap folders of the model and the optimizer


def test_the_same_training_in_memory_does_not_fit(cgroup: Path, checkpoint: Path, workdir: Path) -> None:
    """The limit is real: training in memory is killed (or fails to allocate) inside the same cgroup."""
    done = _run(cgroup, LIMIT, "memory", checkpoint, workdir)
    assert done.returncode != 0


def test_a_configuration_the_cgroup_cannot_hold_is_refused_up_front(cgroup: Path, checkpoint: Path,
                                                                     workdir: Path) -> None:
    done = _run(cgroup, LIMIT, "offload", checkpoint, workdir, budget=LIMIT)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"MemoryError: offload_parameters(budget_bytes={LIMIT}) needs" in done.stderr, done.stderr[-2000:]
    assert "memory cgroup" in done.stderr and "left" in done.stderr


def test_the_optimizer_counts_what_the_offloaded_step_still_needs(cgroup: Path, checkpoint: Path,
                                                                  workdir: Path) -> None:
    """offload_parameters' check passes on its own, but its step's memory (not used yet when the optimizer
    is made) and the optimizer's pool together exceed the cgroup: the optimizer refuses, with both."""
    done = _run(cgroup, LIMIT, "offload", checkpoint, workdir, budget=96 << 20)
    assert done.returncode == 1, done.stderr[-3000:]
    assert (f"MemoryError: OffloadedOptimizer(budget_bytes={96 << 20}) with the training step of the "
            "offloaded model") in done.stderr, done.stderr[-2000:]
