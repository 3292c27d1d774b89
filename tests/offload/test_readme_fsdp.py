"""The README's FSDP2 example runs as it stands under torchrun on 2 ranks (gloo), and trains: its losses fall
and bytes are read from the drive."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Several ranks: FSDP2's shards on each rank's drive"):]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_readme_fsdp_example_runs_under_torchrun(tmp_path: Path) -> None:
    code = example()
    assert "offload_shards(model, folder" in code
    folder = tmp_path / "swap"
    script = tmp_path / "train_fsdp.py"
    script.write_text(code.replace('"/tmp/deepnvme-fsdp/', f'"{folder}/'))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(script)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 6, done.stdout
    losses = [float(ln.split()[3]) for ln in lines]
    assert losses[-1] < losses[0], losses
    assert int(lines[-1].split()[5]) > 0
    assert sorted(os.listdir(folder)) == ["checkpoint", "rank0", "rank1"]
    assert (folder / "checkpoint" / ".metadata").exists()  # dcp_save's checkpoint, complete
    assert all(os.listdir(folder / r) == [] for r in ("rank0", "rank1"))  # each rank's files are gone
    shutil.rmtree(folder)
