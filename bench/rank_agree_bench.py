"""What the ranks' agreement after each offloaded unit's hook costs (rank_errors.agree, nothing failing):
microseconds a call on N gloo ranks of one machine, beside one all_reduce of the same flag on the default
group (the floor: one collective) and the step of the training bench it would add to.

    python bench/rank_agree_bench.py --world 2 --calls 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepnvme.offload.train.rank_errors import agree, group_of


def _rank(rank: int, world: int, rendezvous: str, calls: int, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    group = group_of(distribute_tensor(torch.zeros(world), mesh, [Shard(0)]))
    flag = torch.zeros(1, dtype=torch.int32)
    times: dict[str, list[float]] = {"agree": [], "all_reduce": []}
    for _ in range(repeats):  # interleaved
        for name in times:
            dist.barrier()
            began = time.perf_counter()
            for _ in range(calls):
                if name == "agree":
                    agree(lambda: None, group)
                else:
                    dist.all_reduce(flag)
            times[name].append((time.perf_counter() - began) / calls * 1e6)
    if rank == 0:
        for name, got in times.items():
            print(f"{name:>10}: {statistics.median(got):7.1f} us a call (median of {repeats} x {calls})")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = f"file://{os.path.join(tmp, uuid.uuid4().hex)}"
        mp.spawn(_rank, args=(args.world, rendezvous, args.calls, args.repeats), nprocs=args.world)


if __name__ == "__main__":
    main()
