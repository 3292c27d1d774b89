"""One rank of tests/offload/test_fsdp2_memory.py, started inside its own memory cgroup: a model of linear
blocks built on the meta device, sharded by FSDP2, its shards made from a checkpoint a unit at a time and
kept on the drive, trained a few steps with AdamW's state on the drive, then (given a folder) saved with
dcp_save, loaded back with dcp_load and stepped once more; prints a JSON line of what it saw.

argv: rank world rendezvous checkpoint swap_dir blocks width budget opt_budget steps [dcp_folder]
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from deepnvme.offload import OffloadedOptimizer, dcp_load, dcp_save, offload_shards


def blocks_model(blocks: int, width: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)])


def main() -> None:
    rank, world, rdv, ckpt, swap = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    blocks, width, budget, opt_budget, steps = (int(x) for x in sys.argv[6:11])
    saved = sys.argv[11] if len(sys.argv) > 11 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rdv, rank=rank, world_size=world)
    try:
        with torch.device("meta"):
            model = blocks_model(blocks, width)
        for block in model:
            fully_shard(block)
        fully_shard(model)
        folder = os.path.join(swap, f"rank{rank}")
        shards = offload_shards(model, folder, budget, checkpoint=ckpt)
        opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), folder, opt_budget)
        gen = torch.Generator().manual_seed(rank)
        losses, began = [], time.perf_counter()
        for _ in range(steps):
            x = torch.randn(4, width, generator=gen)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        seconds = (time.perf_counter() - began) / steps
        if saved is not None:  # the whole of it through DCP, streamed, inside the same limit
            dcp_save(saved, model, opt, extra={"step": steps})
            dcp_load(saved, model, opt, extra={"step": 0})
            loss = model(torch.randn(4, width, generator=gen)).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        stats = shards.stats()
        shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
        opt.close()
        shards.close(restore=False)
        status = open("/proc/self/status").read()
        peak = int(status.split("VmHWM:")[1].split()[0]) << 10
        print(json.dumps({"rank": rank, "losses": losses, "s_per_step": seconds, "peak_rss": peak,
                          "memory_bytes": shards.memory_bytes, "shard_bytes": shard_bytes,
                          "bytes_read": stats["bytes_read"], "bytes_written": stats["bytes_written"],
                          "left": os.listdir(folder)}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - the test reads the error from stderr and the exit status
        traceback.print_exc()
        sys.stderr.flush()
        # Not the interpreter's own exit: after a raise, with both ranks tearing gloo down at once, its
        # finalisation now and then ended in "terminate called without an active exception" (SIGABRT), in
        # torch's threads, after the error was printed and the process group destroyed.
        os._exit(1)
