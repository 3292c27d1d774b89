#!/usr/bin/env python3
"""DeepSpeed 0.19.8's ZeRO-3 optimizer step with offload_optimizer to NVMe, for bench/offload_bench.py.

Runs under DeepSpeed's own interpreter (its venv), one process, world size 1, DS_ACCELERATOR=cpu. It builds
the bench's model (same layers, same seed), wraps it with deepspeed.initialize (ZeRO stage 3,
`offload_optimizer: {device: nvme, pipeline_read: true, pipeline_write: true}`, DeepSpeed's default aio
settings and buffer_count), runs one warm-up step, then answers each line "STEP" on stdin with
"<seconds> <cpu seconds> <locked bytes>" for one optimizer step (the engine's optimizer.step alone, timed
around DeepSpeed's own call), until stdin closes. The first line is "READY" or "UNAVAILABLE <reason>".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--nvme", required=True)
    a = ap.parse_args()
    try:
        import deepspeed
        import torch
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)])
        config = {
            "train_batch_size": 4,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": a.nvme, "pipeline_read": True,
                                      "pipeline_write": True},
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
        opt = engine.optimizer
        timing = {}
        inner_step = opt.step

        def timed_step(*args: object, **kw: object) -> object:
            t, c = time.perf_counter(), time.process_time()
            out = inner_step(*args, **kw)
            timing["s"], timing["cpu"] = time.perf_counter() - t, time.process_time() - c
            return out

        opt.step = timed_step
        x = torch.randn(4, a.width)

        def step() -> None:
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()

        step()
        locked = locked_bytes(opt)
    except Exception as exc:  # noqa: BLE001 - reported to the bench, which goes on without DeepSpeed
        traceback.print_exc(file=sys.stderr)
        print(f"UNAVAILABLE {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        return
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "STEP":
            continue
        try:
            step()
            print(f"{timing['s']} {timing['cpu']} {locked}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"ERROR {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
    dist.destroy_process_group()


def locked_bytes(opt: object) -> int:
    """The pinned swap buffers of DeepSpeed's optimizer swapper (buffer_count x the largest sub-group)."""
    swapper = getattr(opt, "optimizer_swapper", None)
    manager = getattr(swapper, "swap_buffer_manager", None)
    buffers = getattr(manager, "buffers", None) or []
    total = sum(b.numel() * b.element_size() for b in buffers)
    if not total:  # older layouts: count from the manager's settings
        count = getattr(manager, "count", 0)
        total = count * getattr(manager, "num_elems", 0) * 4
    return int(total)


if __name__ == "__main__":
    main()
