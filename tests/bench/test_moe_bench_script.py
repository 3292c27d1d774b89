"""bench/moe_bench.py end to end at its smallest (one small shape, one repeat, no DeepSpeed, no all-to-all):
every contender named runs in its worker, the experts' products alone are timed beside the layer, and the
report has the step-time row with its ratio columns. Nothing here is timed: a tiny run's figures mean
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTENDERS = ["deepnvme op", "deepnvme loop", "products kept", "products C"]


def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "moe"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_bench.py"), "--shapes", "64x4x2",
                           "--expert", "ffn", "--ffn", "64", "--repeats", "1", "--no-deepspeed", "--no-a2a",
                           "--contenders", ",".join(CONTENDERS), "--out", str(out)],
                          capture_output=True, text=True, timeout=280, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = out.with_suffix(".md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| config | C |"))
    assert all(f"| {c} |" in header for c in CONTENDERS) and "bound: DS/products kept" in header, header
    row = next(line for line in report.splitlines() if line.startswith("| S=64 E=4 k=2 | 40 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(c != "—" for c in cells[2:6]), row  # every contender timed; the ratios need DeepSpeed
    times = json.loads(out.with_suffix(".json").read_text())["times"]["S=64 E=4 k=2"]
    assert sorted(times) == sorted(CONTENDERS) and all(s[0][0] > 0 for s in times.values())
