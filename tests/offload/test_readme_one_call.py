"""The README's one-call inference example runs as it stands (in a process of its own, as a user would paste
it), and its tokens are those of the same folder loaded in memory by transformers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.offload.stream_models import require_hf

require_hf()

ROOT = Path(__file__).resolve().parents[2]


def example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Inference: weights streamed from the drive"):]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_readme_one_call_example_runs_and_matches_memory(tmp_path: Path) -> None:
    code = example()
    assert "deepnvme.offload.from_pretrained(folder" in code
    check = """
want = transformers.AutoModelForCausalLM.from_pretrained(folder).eval().generate(
    torch.tensor([[1, 2, 3, 4]]), max_new_tokens=8, do_sample=False)
print("SAME" if torch.equal(tokens, want) else "DIFFERENT")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import torch\ntorch.manual_seed(0)\n" + code + check],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "SAME" and "bytes read" in lines[-2]
    assert int(lines[-2].split()[-3]) > 0
