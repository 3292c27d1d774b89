"""bench/ckpt_bench.py: the pilot's best grid point of each operation is measured again as the bound, and
ratios are taken to those new samples. Nothing here is timed: the samples are made up."""

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


def test_bound_is_the_pilots_best_point_measured_again_and_ratios_use_it() -> None:
    grid = [contender("raw bs 1M QD32 x1", "raw-1M-32-1", [1.0, 1.0, 1.0], [0.25, 0.25, 0.25], "grid"),
            contender("raw bs 8M QD32 x2", "raw-8M-32-2", [0.5, 0.6, 0.4], [0.5, 0.5, 0.5], "grid")]
    assert ckpt_bench.bound_of(grid, 2 * GB, "save") is grid[1]  # 4 GB/s write in the pilot
    assert ckpt_bench.bound_of(grid, 2 * GB, "load") is grid[0]  # 8 GB/s read in the pilot
    bounds = ckpt_bench.confirmed_bounds(grid, 2 * GB)
    assert [(b.name, b.bound_for, b.group) for b in bounds] == [
        ("bound raw bs 8M QD32 x2", ("save",), "bound"), ("bound raw bs 1M QD32 x1", ("load",), "bound")]
    assert bounds[0].kind != grid[1].kind  # a file of its own
    # Measured again beside the contenders: slower than the pilot's luckiest medians.
    bounds[0].samples["save"], bounds[0].samples["load"] = [0.625, 0.625, 0.625], [0.4, 0.4, 0.4]
    bounds[1].samples["save"], bounds[1].samples["load"] = [2.0, 2.0, 2.0], [0.4, 0.4, 0.4]
    for b in bounds:
        b.samples["save_cpu"], b.samples["load_cpu"] = [0.1] * 3, [0.2] * 3
    ours = contender("deepnvme.save / deepnvme.load", "deepnvme", [0.625, 0.625, 0.625], [0.5, 0.5, 0.5])
    lines, ratios = ckpt_bench.report("sd", 2 * GB, 3, [ours, *bounds, *grid], 3, 2)
    assert ratios["deepnvme.save / bound write"] == 1.0  # against 3.2 GB/s, not the pilot's 4
    assert ratios["deepnvme.load / bound read"] == 0.8  # against 5 GB/s, not the pilot's 8
    text = "\n".join(lines)
    assert "best grid point (write: bs 8M QD32 x2; read: bs 1M QD32 x1) | 3.20 (3.20–3.20)" in text
    assert "Its best, 4.00 write and 8.00 read, picked the setting" in text
    assert "deepnvme.save / bound write: 1.00× (per-repeat 1.00×; target ≥ 0.9×: met)" in text
    assert "deepnvme.load / bound read: 0.80× (per-repeat 0.80×; target ≥ 0.9×: NOT met)" in text
    assert "| deepnvme.save / deepnvme.load | 3.20 (3.20–3.20) | 0.05 | 4.00 (4.00–4.00) | 0.10 |" in text
    assert "| bs 1M QD32 x1 | 2.00 | 8.00 |" in text  # the pilot's grid table


def test_one_point_best_at_both_is_one_bound() -> None:
    grid = [contender("raw bs 1M QD32 x1", "raw-1M-32-1", [1.0] * 2, [1.0] * 2, "grid"),
            contender("raw bs 4M QD32 x1", "raw-4M-32-1", [0.5] * 2, [0.5] * 2, "grid")]
    bounds = ckpt_bench.confirmed_bounds(grid, GB)
    assert [(b.name, b.bound_for) for b in bounds] == [("bound raw bs 4M QD32 x1", ("save", "load"))]


def test_the_write_bound_reads_nothing_and_the_read_bound_writes_its_own_file() -> None:
    """Two points: the write's bound is not also timed reading (a cold read nobody reports), the read's
    bound writes the file it reads."""
    def write(sd: dict, path: Path) -> None: ...

    def read(path: Path, shapes: list) -> None: ...

    grid = [contender("raw bs 1M QD32 x1", "raw-1M-32-1", [1.0], [0.25], "grid"),
            contender("raw bs 8M QD32 x2", "raw-8M-32-2", [0.5], [0.5], "grid")]
    for c in grid:
        c.save, c.load = write, read
    save_bound, load_bound = ckpt_bench.confirmed_bounds(grid, GB)
    assert (save_bound.bound_for, save_bound.save, save_bound.load) == (("save",), write, None)
    assert (load_bound.bound_for, load_bound.save, load_bound.load) == (("load",), write, read)
    (both,) = ckpt_bench.confirmed_bounds(grid[1:], GB)
    assert (both.bound_for, both.save, both.load) == (("save", "load"), write, read)
    groups = ckpt_bench.by_file([*ckpt_bench.confirmed_bounds(grid, GB)])
    assert [[c.name for c in g] for g in groups] == [["bound raw bs 8M QD32 x2"], ["bound raw bs 1M QD32 x1"]]


def test_the_json_says_which_samples_are_the_pilots_and_which_the_bound() -> None:
    grid = [contender("raw bs 1M QD32 x1", "raw-1M-32-1", [1.0], [0.25], "grid")]
    bound = ckpt_bench.confirmed_bounds(grid, GB)
    ours = contender("deepnvme.save / deepnvme.load", "deepnvme", [0.5], [0.5])
    record = ckpt_bench.contenders_record([ours, *bound, *grid])
    assert record["raw bs 1M QD32 x1"]["group"] == "grid"
    assert record["raw bs 1M QD32 x1"]["save"] == [1.0]
    assert record["bound raw bs 1M QD32 x1"]["group"] == "bound"
    assert record["bound raw bs 1M QD32 x1"]["bound_for"] == ["save", "load"]
    assert record["deepnvme.save / deepnvme.load"]["group"] == "main"
    assert "bound_for" not in record["deepnvme.save / deepnvme.load"]


def test_the_references_use_the_handle_deepnvme_save_uses(tmp_path: Path) -> None:
    """With a tuned file in the checkpoint directory, the raw write committed atomically (the measure of
    what atomicity adds to deepnvme.save) moves the bytes with deepnvme.save's handle, not the built-in
    settings."""
    import json

    import torch

    from deepnvme._core.handles import TUNED_FILE, checkpoint_handle

    (tmp_path / TUNED_FILE).write_text(json.dumps({"block_size": 2 << 20, "queue_depth": 8,
                                                   "intra_op_parallelism": 1}))
    locked = ckpt_bench.LockedBytes({"w": torch.arange(1000, dtype=torch.float32)}, tmp_path)
    try:
        atomic, *_ = ckpt_bench.raw_references(locked)
        atomic.save({}, tmp_path / "raw.bin")
        assert (tmp_path / "raw.bin").read_bytes() == locked.buffer.numpy().tobytes()
        h = atomic.save.__closure__[[n for n in atomic.save.__code__.co_freevars].index("h")].cell_contents
        assert h is checkpoint_handle(tmp_path)
        assert (h.get_block_size(), h.get_queue_depth()) == (2 << 20, 8)
    finally:
        locked.free()
