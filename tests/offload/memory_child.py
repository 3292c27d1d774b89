"""Run in a child process by test_memory.py: trains with an offloaded optimizer and reports memory figures.

argv: directory, budget bytes, width and number of the model's layers, steps. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
from torch import nn

from deepnvme.offload import OffloadedOptimizer
from deepnvme.offload._doors import locked_bytes

KIB = 1024


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def main() -> None:
    directory, budget = sys.argv[1], int(sys.argv[2])
    width, layers, steps = (int(a) for a in sys.argv[3:6])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(4, width)
    locked_base = locked_bytes()
    opt = OffloadedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-4), directory, budget)
    locked_seen = []
    opt.optimizer.register_step_pre_hook(lambda *_: locked_seen.append(locked_bytes() - locked_base))

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        net(x).sum().backward()
        opt.step()

    step()  # the first step makes the state (in memory, a tile at a time) and the gradients
    step()
    rss_before = status("VmRSS")
    reset_peak()
    step()
    peak_growth = status("VmHWM") - rss_before
    rss = [], []
    fds, threads = [], []
    for i in range(steps):
        step()
        if i in (steps // 10, steps - 1):
            rss[0].append(status("VmRSS"))
            fds.append(len(os.listdir("/proc/self/fd")))
            threads.append(threading.active_count())
    state_bytes = opt.swap.reserved_bytes
    peak_in_use = opt.swap.pool.peak_in_use
    growth = {}
    ckpt = os.path.join(directory, "ckpt.pt")
    for what, fn in (("save", lambda: opt.save(ckpt)), ("load", lambda: opt.load(ckpt))):
        before = status("VmRSS")
        reset_peak()
        fn()
        growth[what] = status("VmHWM") - before
    os.unlink(ckpt)
    opt.close()
    print(json.dumps({"state_bytes": state_bytes, "peak_growth": peak_growth, "locked_max": max(locked_seen),
                      "peak_in_use": peak_in_use, "rss": rss[0], "fds": fds, "threads": threads,
                      "locked_after": locked_bytes() - locked_base, "save_growth": growth["save"],
                      "load_growth": growth["load"],
                      "left": os.listdir(directory)}))


if __name__ == "__main__":
    main()
