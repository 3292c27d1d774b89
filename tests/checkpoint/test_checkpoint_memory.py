"""Peak extra memory of deepnvme.save and deepnvme.load stays within the bounds the README states.

Measured in a fresh interpreter (nothing else of the test session in its memory) with the kernel's resident
high-water mark: writing 5 to /proc/self/clear_refs resets VmHWM to the current VmRSS, so VmHWM after the
call minus VmRSS before it is the call's peak extra resident memory, exactly (bench/_harness.py measures
the same way). The handle and its staging pool are made by a first save and load, as they are once per
process; the bound is for every save and load after that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme.serialization import STAGING_BYTES

REPO = Path(__file__).resolve().parents[2]
SLACK = 8 << 20  # the interpreter's own allocations around the call, pickling the structure included

CHILD = r"""
import json, os, re, sys
import torch, deepnvme

def status(key):
    text = open("/proc/self/status").read()
    return int(re.search(rf"^{key}:\s+(\d+)", text, re.M).group(1)) * 1024

def peak(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS")
    kept = fn()
    return status("VmHWM") - start, kept

g = torch.Generator().manual_seed(0)
sd = {f"big{i}": torch.randn(4 << 20, generator=g) for i in range(4)}  # 64 MiB through the handle
sd |= {f"small{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(200)}  # staged records
path = sys.argv[1]
deepnvme.save(sd, path + ".first")
deepnvme.load(path + ".first")
out = {"small": sum(t.nbytes for k, t in sd.items() if k.startswith("small"))}
out["save"], _ = peak(lambda: deepnvme.save(sd, path))
out["load"], got = peak(lambda: deepnvme.load(path))
out["file"] = os.path.getsize(path)
out["equal"] = all(torch.equal(got[k], v) for k, v in sd.items())
print(json.dumps(out))
"""


def test_peak_extra_memory_of_save_and_load(tmp_path: Path) -> None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs is not writable here: the high-water mark cannot be reset")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "m.pt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["equal"]
    # save: the two staging buffers for the records between payloads; the payloads go from the tensors
    assert got["save"] <= 2 * STAGING_BYTES + SLACK, got
    # load: the file's bytes become the loaded tensors; small members pass through the scratch buffer again
    assert got["load"] >= got["file"] // 2, got  # the measurement does see the loaded state
    assert got["load"] <= got["file"] + got["small"] + SLACK, got
