"""Build benchmark: cold JIT build and warm load of async_io, beside a one-file torch extension.

Each measurement runs in a fresh interpreter with a fresh TORCH_EXTENSIONS_DIR (cold) or the cache the cold
run left (warm). Wall time and CPU-seconds (the child and everything it spawned) are both reported, since
on a small machine a parallel build can look fast in wall time while burning many CPU-seconds.

    python bench/build_bench.py [--repeat 3] [--json out.json]

Targets: cold build <= 1.5x the yardstick; warm load <= 0.3 s beyond `import torch`.
DeepSpeed's async_io is measured too when `deepspeed` is importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _harness import ROOT as REPO
from _harness import children_cpu, wall

YARDSTICK_CPP = r"""
#include <torch/extension.h>
torch::Tensor twice(const torch::Tensor &t) { return t * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""

# Each child prints one JSON line: seconds spent in `import torch` and in loading the op after it.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
{load}
t2 = time.perf_counter()
print("BENCH " + json.dumps({{"torch": t1 - t0, "load": t2 - t1}}))
"""

LOADERS = {
    "deepnvme async_io": "from op_builder import AsyncIOBuilder\nAsyncIOBuilder().load()",
    "yardstick (1 file)": ("from torch.utils.cpp_extension import load\n"
                           "load(name='yardstick', sources=[sys.argv[1]], extra_cflags=['-O3'])"),
    "DeepSpeed async_io": "from deepspeed.ops.op_builder import AsyncIOBuilder\nAsyncIOBuilder().load()",
}


def run_child(load: str, ext_dir: Path, arg: str = "") -> dict[str, float]:
    """Run one load in a fresh interpreter; return its timings plus wall and CPU-seconds seen from here."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    before = children_cpu()
    done: list[subprocess.CompletedProcess] = []
    took = wall(lambda: done.append(subprocess.run([sys.executable, "-c", CHILD.format(load=load), arg],
                                                   env=env, capture_output=True, text=True)))
    cpu = children_cpu() - before
    proc = done[0]
    if proc.returncode != 0:
        raise RuntimeError(f"child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH "))
    data = json.loads(line[len("BENCH "):])
    data["wall"] = took
    data["cpu"] = cpu
    return data


def measure(label: str, repeat: int, work: Path, arg: str = "") -> dict[str, float]:
    """Cold build (fresh cache) then `repeat` warm loads; medians of the warm figures."""
    ext = Path(tempfile.mkdtemp(prefix="ext_", dir=work))
    cold = run_child(LOADERS[label], ext, arg)
    warm = [run_child(LOADERS[label], ext, arg) for _ in range(repeat)]
    return {"cold_wall": cold["wall"], "cold_cpu": cold["cpu"], "cold_load": cold["load"],
            "warm_beyond_torch": statistics.median(w["load"] for w in warm),
            "warm_torch": statistics.median(w["torch"] for w in warm),
            "warm_wall": statistics.median(w["wall"] for w in warm)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="warm loads per op (median reported)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="deepnvme_build_bench_") as tmp:
        work = Path(tmp)
        src = work / "yardstick.cpp"
        src.write_text(textwrap.dedent(YARDSTICK_CPP))
        labels = ["yardstick (1 file)", "deepnvme async_io"]
        if importlib.util.find_spec("deepspeed") is not None:
            labels.append("DeepSpeed async_io")
        for label in labels:
            print(f"measuring {label} ...", file=sys.stderr, flush=True)
            results[label] = measure(label, args.repeat, work, str(src))

    base = results["yardstick (1 file)"]["cold_wall"]
    print(f"\n{'op':<22} {'cold wall s':>11} {'cold CPU s':>10} {'x yardstick':>11} "
          f"{'warm load s':>11} {'(import torch s)':>16}")
    for label, r in results.items():
        print(f"{label:<22} {r['cold_wall']:>11.1f} {r['cold_cpu']:>10.1f} {r['cold_wall'] / base:>11.2f} "
              f"{r['warm_beyond_torch']:>11.3f} {r['warm_torch']:>16.2f}")
    ours = results["deepnvme async_io"]
    ratio = ours["cold_wall"] / base
    print(f"\ntargets: cold <= 1.5x yardstick -> {ratio:.2f}x {'OK' if ratio <= 1.5 else 'MISSED'}; "
          f"warm <= 0.3 s beyond import torch -> {ours['warm_beyond_torch']:.3f} s "
          f"{'OK' if ours['warm_beyond_torch'] <= 0.3 else 'MISSED'}")
    print("(warm load = seconds from the end of `import torch` to the loaded module, in a fresh process)")
    if "DeepSpeed async_io" not in results:
        print("DeepSpeed is not importable here: its row is left out.")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
