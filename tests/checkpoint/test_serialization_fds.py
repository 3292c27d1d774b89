"""deepnvme.save and deepnvme.load of thousands of small tensors under a low descriptor limit.

load queues a read per payload (and per gap between payloads) by one descriptor of the checkpoint; a
duplicate of that descriptor per pending read took about 1600 descriptors for 4400 tensors and failed with
EMFILE under `ulimit -n 1024`. Runs in a child process, which lowers RLIMIT_NOFILE for itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, resource, sys, threading, time
import torch
import deepnvme

path, n = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
# About 64 KiB each, sizes not multiples of a page: every payload is a read of its own, with unaligned edges.
state = {f"t{i}": torch.full((16384 + i % 7,), float(i)) for i in range(n)}
deepnvme.save(state, path)
peak, stop = [0], threading.Event()

def watch():
    while not stop.is_set():
        peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
        time.sleep(0.0005)

base = len(os.listdir("/proc/self/fd"))
watcher = threading.Thread(target=watch)
watcher.start()
try:
    out = deepnvme.load(path)
finally:
    stop.set()
    watcher.join()
same = len(out) == n and all(torch.equal(out[k], v) for k, v in state.items())
print(json.dumps({"base": base, "peak": peak[0], "same": same}))
"""


def test_load_of_thousands_of_tensors_under_a_low_descriptor_limit(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "many.pt"), "2000"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["same"], out
    # The checkpoint, its O_DIRECT reopen, load's handles and one shared duplicate (with its buffered
    # reopen for the unaligned edges), not a descriptor per queued read.
    assert out["peak"] - out["base"] <= 32, out
