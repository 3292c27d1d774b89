"""Run by test_train_memory.py inside a memory cgroup: trains a model built on the meta device and filled
from a checkpoint, its parameters, gradients and AdamW state on the drive (or, with mode "memory", the same
training in memory, which the cgroup cannot hold). Prints one JSON line of figures.

argv: mode, checkpoint, swap directory, layers, width, budget bytes, steps.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

from deepnvme.offload import OffloadedOptimizer
from deepnvme.offload._doors import locked_bytes
from deepnvme.offload.train import offload_parameters


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    mode, ckpt, directory = sys.argv[1:4]
    layers, width, budget, steps = (int(a) for a in sys.argv[4:8])
    torch.set_num_threads(2)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    began = time.perf_counter()
    if mode == "memory":
        model.load_state_dict(torch.load(ckpt, weights_only=True), assign=True)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        off = None
    else:
        off = offload_parameters(model, directory, budget, units=list(model), checkpoint=ckpt)
        opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), directory, budget)
    losses, locked = [], 0
    for s in range(steps):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(s))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        locked = max(locked, locked_bytes())
    figures = {"peak_rss": status("VmHWM"), "locked": locked, "losses": losses,
               "s_per_step": (time.perf_counter() - began) / steps,
               "memory_bytes": off.memory_bytes if off is not None else None,
               "stats": off.stats() if off is not None else None}
    if off is not None:
        opt.close()  # type: ignore[attr-defined]
        try:
            off.close()  # the parameters would not fit: refused before anything moves
        except MemoryError as exc:
            figures["close_refused"] = str(exc)
        off.close(restore=False)  # files gone, the parameters not brought back
        figures["files_left"] = sorted(os.listdir(directory))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
