#!/usr/bin/env python3
"""One Linear over experts' rows, forward + backward: torch's grouped mm against deepnvme.moe's segments
path and a loop of F.linear (one autograd node per expert), in one process with interleaved repeats.

    python3 bench/grouped_mm_bench.py [--experts 64] [--rows 150-320] [--width 1024] [--repeats 5]
                                      [--threads 1] [--dtype float32|bfloat16] [--device cpu|cuda]

Why it exists: deepnvme.moe.grouped.choose() takes segments over torch's grouped mm on the CPU because of
what this measures. Every contender gets the same rows, weights, biases and output gradient; GFLOP/s
counts the three products of a Linear (forward, input gradient, weight gradient).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _harness import ROOT  # noqa: F401 - first: puts this checkout on sys.path


def contenders(x: Any, w: Any, b: Any, g: Any, counts: list[int]) -> dict[str, Any]:
    """name -> a function running forward and backward once."""
    import torch
    import torch.nn.functional as F

    from deepnvme.moe.grouped import GroupedExperts, pack

    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    experts = [torch.nn.Linear(w.shape[2], w.shape[1], device=x.device, dtype=x.dtype) for _ in counts]
    with torch.no_grad():
        for e, lin in enumerate(experts):
            lin.weight.copy_(w[e])
            lin.bias.copy_(b[e])
    pack(experts)  # as deepnvme.moe's Experts keeps them: one [E, ...] tensor per name
    plan = GroupedExperts.of(experts)

    def grouped_mm() -> None:
        xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
        y = F.grouped_mm(xr, wr.transpose(1, 2), offs=offs) + br.repeat_interleave(
            torch.tensor(counts, device=x.device), dim=0)
        torch.autograd.grad(y, (xr, wr, br), g)

    def segments() -> None:
        xr = x.detach().requires_grad_()
        y = plan.run(xr, counts, "segments")  # type: ignore[union-attr]
        torch.autograd.grad(y, [xr, *(p for lin in experts for p in lin.parameters())], g)

    def loop() -> None:
        xr = x.detach().requires_grad_()
        y = torch.cat([lin(part) for lin, part in zip(experts, xr.split(counts))])
        torch.autograd.grad(y, [xr, *(p for lin in experts for p in lin.parameters())], g)

    return {"torch grouped mm": grouped_mm, "segments": segments, "loop of F.linear": loop}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--rows", default="150-320", help="rows per expert, drawn uniformly from LO-HI (seeded)")
    p.add_argument("--width", type=int, default=1024, help="in and out features of the Linear")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    lo, hi = (int(v) for v in args.rows.split("-"))
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(lo, hi + 1, (args.experts,), generator=gen).tolist()
    rows, n = sum(counts), args.width
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    x = torch.randn(rows, n, generator=gen).to(dev, dtype)
    w = (torch.randn(args.experts, n, n, generator=gen) * n ** -0.5).to(dev, dtype)
    b = torch.randn(args.experts, n, generator=gen).to(dev, dtype)
    g = torch.randn(rows, n, generator=gen).to(dev, dtype)
    runs = contenders(x, w, b, g, counts)
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.repeats + 1):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runs[name]()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    flop = 3 * 2 * rows * n * n
    base = statistics.median(times["loop of F.linear"])
    print(f"# one Linear {n}x{n}, {args.experts} experts, {rows} rows ({args.rows} each), {args.dtype}, "
          f"{args.device}, {args.threads} thread(s), {args.repeats} interleaved repeats; "
          f"torch {torch.__version__}")
    print("| path | median s | GFLOP/s | loop time / this |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {flop / med / 1e9:.1f} | {base / med:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
