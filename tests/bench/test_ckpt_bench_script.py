"""bench/ckpt_bench.py: the bound is the best grid point of each operation, and ratios are taken to it.
Nothing here is timed: the samples are made up."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ckpt_bench  # noqa: E402

GB = 10**9


def contender(name: str, kind: str, save: list[float], load: list[float],
              group: str = "main") -> ckpt_bench.Contender:
    """A contender with these seconds per sample, 0.1 CPU-s per save and 0.2 per load."""
    c = ckpt_bench.Contender(name, None, None, kind, group=group)
    c.samples["save"], c.samples["load"] = save, load
    c.samples["save_cpu"], c.samples["load_cpu"] = [0.1] * len(save), [0.2] * len(load)
    return c


def test_bound_is_the_best_grid_point_per_operation_and_ratios_use_it() -> None:
    grid = [contender("raw bs 1M QD32 x1", "raw-1M-32-1", [1.0, 1.0, 1.0], [0.25, 0.25, 0.25], "grid"),
            contender("raw bs 8M QD32 x2", "raw-8M-32-2", [0.5, 0.6, 0.4], [0.5, 0.5, 0.5], "grid")]
    ours = contender("deepnvme.save / deepnvme.load", "deepnvme", [0.625, 0.625, 0.625], [0.5, 0.5, 0.5])
    lines, ratios = ckpt_bench.report("sd", 2 * GB, 3, [ours, *grid], 3)
    assert ckpt_bench.bound_of(grid, 2 * GB, "save") is grid[1]  # 4 GB/s write
    assert ckpt_bench.bound_of(grid, 2 * GB, "load") is grid[0]  # 8 GB/s read
    assert ratios["deepnvme.save / bound write"] == 0.8
    assert ratios["deepnvme.load / bound read"] == 0.5
    text = "\n".join(lines)
    assert "write: bs 8M QD32 x2; read: bs 1M QD32 x1" in text
    assert "deepnvme.save / bound write: 0.80× (per-repeat 0.80×; target ≥ 0.9×: NOT met)" in text
    assert "| deepnvme.save / deepnvme.load | 3.20 (3.20–3.20) | 0.05 | 4.00 (4.00–4.00) | 0.10 |" in text
