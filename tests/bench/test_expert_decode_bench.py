"""bench/expert_decode_bench.py end to end at its smallest (--tiny, one repeat, two tokens): every contender
runs in a process of its own, decodes the tokens of the model in memory with the same experts path, and the
report has a row per model and batch. Nothing here is timed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "expert_decode"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "expert_decode_bench.py"), "--tiny",
                           "--repeats", "1", "--tokens", "2", "--workdir", str(tmp_path / "wd"), "--out",
                           str(out)], capture_output=True, text=True, timeout=280, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = out.with_suffix(".md").read_text()
    rows = [line for line in report.splitlines() if line.startswith(("| hf |", "| moe_gpt |"))]
    assert len(rows) == 4 and all(line.endswith("| yes |") for line in rows), report
    samples = json.loads(out.with_suffix(".json").read_text())
    assert samples["moe_gpt"]["auto"][0]["last_path"].endswith("streamed segments")
    assert samples["moe_gpt"]["loop"][0]["last_path"].endswith("loop per block")
    for per in samples.values():
        for runs in per.values():
            assert runs[0]["expert_misses"] > 0  # the experts were streamed, read once into the cache
