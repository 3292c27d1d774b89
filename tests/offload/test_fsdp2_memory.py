"""Training beyond memory on several ranks, each held to its own memory cgroup (v1 here, page cache and
locked memory counted): every rank's shard of parameters + gradients + AdamW state is 4x its cgroup's limit,
and 2 ranks train inside their limits, the model built on the meta device and its shards made from a
checkpoint a unit at a time, then save and load it all through torch.distributed.checkpoint (dcp_save,
dcp_load: streamed) and step again; a rank whose cgroup cannot hold a step is refused up front with the
numbers (issue 37)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cgroups import argv_in, memory_cgroup

import deepnvme

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, WIDTH = 64, 2048  # 64 x 16 MiB: 1 GiB of fp32 parameters, 512 MiB a rank
LIMIT = 512 << 20
BUDGET, OPT_BUDGET = 72 << 20, 32 << 20


@pytest.fixture
def cgroups() -> Iterator[list[Path]]:
    """Two child memory cgroups of the v1 hierarchy (removed after)."""
    with memory_cgroup(f"deepnvme-fsdp-{os.getpid()}-0") as first, \
            memory_cgroup(f"deepnvme-fsdp-{os.getpid()}-1") as second:
        yield [first, second]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    sd = {}
    for i in range(BLOCKS):
        sd[f"{i}.0.weight"] = torch.randn(WIDTH, WIDTH) * WIDTH ** -0.5
        sd[f"{i}.0.bias"] = torch.zeros(WIDTH)
    deepnvme.save(sd, path)
    return path


def _launch(cgroups: list[Path], limit: int, checkpoint: Path, swap: Path, budget: int,
            steps: int, saved: Path | None = None) -> list[subprocess.CompletedProcess[str]]:
    rdv = f"file://{swap.parent}/rdv-{uuid.uuid4().hex}"
    procs = []
    for rank, cg in enumerate(cgroups):
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        args = [sys.executable, "-m", "tests.offload.fsdp_memory_child", str(rank), str(len(cgroups)), rdv,
                str(checkpoint), str(swap), str(BLOCKS), str(WIDTH), str(budget), str(OPT_BUDGET), str(steps)]
        args += [] if saved is None else [str(saved)]
        procs.append(subprocess.Popen(argv_in(cg, args), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                           # DCP's writer stages its small unaligned writes through the
                                           # process's staging pool (128 MiB by default): 16 MiB here.
                                           "DEEPNVME_STAGING_BUFFERS": "16"}))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_each_rank_trains_inside_a_cgroup_a_quarter_of_its_share(cgroups: list[Path], checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    done = _launch(cgroups, LIMIT, checkpoint, swap, BUDGET, steps=1, saved=tmp_path / "dcp")
    for rank, d in enumerate(done):
        assert d.returncode == 0, (rank, d.stderr[-3000:])
    for rank, (d, cg) in enumerate(zip(done, cgroups)):
        r = json.loads(d.stdout.strip().splitlines()[-1])
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        print(f"\nrank {rank}: shard parameters+gradients+state {4 * r['shard_bytes'] >> 20} MiB in a "
              f"{LIMIT >> 20} MiB cgroup: peak {peak >> 20} MiB (cgroup), RSS {r['peak_rss'] >> 20} MiB, "
              f"{r['s_per_step']:.2f} s/step, {r['bytes_read'] >> 20} MiB read and {r['bytes_written'] >> 20}"
              f" MiB written by the shards, needed up front {r['memory_bytes'] >> 20} MiB")
        assert 4 * r["shard_bytes"] >= 4 * LIMIT  # parameters + gradients + AdamW's two moments
        assert peak <= LIMIT
        assert all(x == x for x in r["losses"]) and len(r["losses"]) == 2
        assert r["left"] == []


def test_a_rank_its_cgroup_cannot_hold_is_refused_up_front(cgroups: list[Path], checkpoint: Path,
                                                            tmp_path: Path) -> None:
    done = _launch(cgroups, LIMIT, checkpoint, tmp_path / "swap", LIMIT, steps=1)
    for d in done:
        assert d.returncode == 1, d.stderr[-3000:]
        want = f"MemoryError: offload_shards(budget_bytes={LIMIT}) with a step's gathered units"
        assert want in d.stderr, d.stderr[-2000:]
        assert "memory cgroup" in d.stderr and "left" in d.stderr
