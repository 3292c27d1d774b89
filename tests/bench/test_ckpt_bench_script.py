"""bench/ckpt_bench.py: the pilot's best grid points of each operation are measured again, the best of those
new samples is the bound, and ratios are taken to it. Nothing here is timed: the samples are made up."""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import _harness  # noqa: E402
import ckpt_bench  # noqa: E402

GB = 10**9


def contender(name: str, kind: str, save: list[float], load: list[float],
              group: str = "main") -> ckpt_bench.Contender:
    """A contender with these seconds per sample, 0.1 CPU-s per save and 0.2 per load."""
    c = ckpt_bench.Contender(name, None, None, kind, group=group)
    c.samples["save"], c.samples["load"] = save, load
    c.samples["save_cpu"], c.samples["load_cpu"] = [0.1] * len(save), [0.2] * len(load)
    return c


def grid_of(save: list[float], load: list[float]) -> list[ckpt_bench.Contender]:
    """One grid point per (save seconds, load seconds) pair, in the pilot."""
    return [contender(f"raw bs {i + 1}M QD32 x1", f"raw-{i + 1}M-32-1", [w], [r], "grid")
            for i, (w, r) in enumerate(zip(save, load))]


def rerun(c: ckpt_bench.Contender, save: float, load: float) -> None:
    """The run's samples of a candidate (3 alike), 0.1 / 0.2 CPU-s each."""
    c.samples["save"], c.samples["load"] = [save] * 3, [load] * 3
    c.samples["save_cpu"], c.samples["load_cpu"] = [0.1] * 3, [0.2] * 3


def test_bound_is_the_best_candidate_measured_again_and_ratios_use_it() -> None:
    # Pilot (2 GB): writes 2, 4, 2.5, 1, 3.2 GB/s; reads 8, 4, 2, 5, 6.4 GB/s.
    grid = grid_of([1.0, 0.5, 0.8, 2.0, 0.625], [0.25, 0.5, 1.0, 0.4, 0.3125])
    bounds = ckpt_bench.confirmed_bounds(grid, 2 * GB)
    # The 3 best of each operation: writes 2M, 5M, 3M; reads 1M, 5M, 4M.
    assert [(b.name, b.bound_for, b.group) for b in bounds] == [
        ("bound raw bs 1M QD32 x1", ("load",), "bound"), ("bound raw bs 2M QD32 x1", ("save",), "bound"),
        ("bound raw bs 3M QD32 x1", ("save",), "bound"), ("bound raw bs 4M QD32 x1", ("load",), "bound"),
        ("bound raw bs 5M QD32 x1", ("save", "load"), "bound")]
    assert all(b.kind != g.kind for b in bounds for g in grid)  # files of their own
    # Measured again beside the contenders: the pilot's best are not the run's best, and all read lower.
    for b, (w, r) in zip(bounds, [(2.0, 0.4), (1.0, 1.0), (0.625, 1.0), (1.0, 0.5), (0.8, 0.5)]):
        rerun(b, w, r)
    ours = contender("deepnvme.save / deepnvme.load", "deepnvme", [0.625, 0.625, 0.625], [0.5, 0.5, 0.5])
    small = contender(ckpt_bench.MEMORY_ONLY, "deepnvme", [], [0.8, 0.8, 0.8], "reference")
    huge = contender(ckpt_bench.MEMORY_ONLY_HUGE, "deepnvme", [], [1.0, 1.0, 1.0], "reference")
    zeroed = contender(ckpt_bench.ZEROED, "deepnvme", [], [0.8, 0.8, 0.8], "reference")
    lines, ratios = ckpt_bench.report("sd", 2 * GB, 3, [ours, small, huge, zeroed, *bounds, *grid], 3, 2)
    # The faster memory row (2.5 GB/s, 4 KiB pages) against the bound's 5: half; the load's 4 GB/s against
    # it: above it, which only a load whose new pages the kernel does not zero can be.
    assert ratios["new memory made alone, nothing read (the faster page size) / bound read: a ceiling here "
                  "for a load into new memory the kernel zeroes"] == 0.5
    assert ratios["deepnvme.load / new memory made alone"] == 1.6
    assert ratios["deepnvme.load / deepnvme.load into new memory zeroed by the kernel first"] == 1.6
    assert ratios["deepnvme.save / bound write"] == 1.0  # against 3M's 3.2 GB/s in the run, not 4 (pilot)
    assert ratios["deepnvme.load / bound read"] == 0.8  # against 1M's 5 GB/s in the run, not 8 (pilot)
    text = "\n".join(lines)
    assert "measured again (write: bs 3M QD32 x1; read: bs 1M QD32 x1) | 3.20 (3.20–3.20)" in text
    assert "| bs 1M QD32 x1 | — | 8.00 → 5.00 |" in text
    assert "| bs 5M QD32 x1 | 3.20 → 2.50 | 6.40 → 4.00 |" in text
    assert "deepnvme.save / bound write: 1.00× (per-repeat 1.00×; target ≥ 0.9×: met)" in text
    assert "deepnvme.load / bound read: 0.80× (per-repeat 0.80×; target ≥ 0.9×: NOT met)" in text
    assert "| deepnvme.save / deepnvme.load | 3.20 (3.20–3.20) | 0.05 | 4.00 (4.00–4.00) | 0.10 |" in text
    assert "| bs 2M QD32 x1 | 4.00 | 4.00 |" in text  # the pilot's grid table


def test_one_point_best_at_both_is_one_candidate() -> None:
    grid = grid_of([0.5, 1.0], [0.5, 1.0])
    bounds = ckpt_bench.confirmed_bounds(grid[:1], GB)
    assert [(b.name, b.bound_for) for b in bounds] == [("bound raw bs 1M QD32 x1", ("save", "load"))]


def test_write_candidates_read_nothing_and_read_candidates_write_their_own_file() -> None:
    """A write's candidate is not also timed reading (a cold read nobody reports); a read's candidate writes
    the file it reads."""
    def write(sd: dict, path: Path) -> None: ...

    def read(path: Path, shapes: list) -> None: ...

    # Pilot: writes best at 1M-4M, reads best at 5M-8M (each set of CANDIDATES = 3 plus spares).
    grid = grid_of([0.5, 0.5, 0.5, 0.6, 2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.6])
    for c in grid:
        c.save, c.load = write, read
    bounds = ckpt_bench.confirmed_bounds(grid, GB)
    assert [(b.name[len("bound raw bs "):], b.bound_for) for b in bounds] == [
        ("1M QD32 x1", ("save",)), ("2M QD32 x1", ("save",)), ("3M QD32 x1", ("save",)),
        ("5M QD32 x1", ("load",)), ("6M QD32 x1", ("load",)), ("7M QD32 x1", ("load",))]
    assert all((b.save, b.load) == (write, None) for b in bounds[:3])
    assert all((b.save, b.load) == (write, read) for b in bounds[3:])
    groups = ckpt_bench.by_file(bounds)
    assert [[c.name for c in g] for g in groups] == [[b.name] for b in bounds]


def test_the_json_says_which_samples_are_the_pilots_and_which_the_bound() -> None:
    grid = grid_of([1.0], [0.25])
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


def test_the_load_into_memory_made_before_uses_that_memory_and_loads_exactly(tmp_path: Path) -> None:
    """The reference load whose memory exists before the clock: every large payload lands in the memory
    made for it (so the row measures a load without making memory), the state dict loads exactly, and
    deepnvme.load makes its own memory again afterwards."""
    import deepnvme
    from deepnvme import serialization
    from deepnvme.serialization import prefetch

    shapes = [("a", (300, 1000)), ("b", (40,)), ("c", (512, 1024)), ("d", (300, 1000))]
    sd = ckpt_bench.make_state(shapes)
    path = tmp_path / "m.pt"
    deepnvme.save(sd, path)
    (made_before,) = [c for c in ckpt_bench.contenders(None, False) if c.name == ckpt_bench.MADE_BEFORE]
    original = prefetch._payload_memory
    short = made_before.prepare(shapes)
    short[300 * 1000 * 4].pop()  # one of the two 300x1000 blocks missing: the load refuses, not new memory
    with pytest.raises(RuntimeError, match="no memory of 1200000 bytes"):
        made_before.load(path, short)
    assert prefetch._payload_memory is original
    pool = made_before.prepare(shapes)
    blocks = [b for bs in pool.values() for b in bs]
    spans = []
    for b in blocks:
        start = ckpt_bench.torch.frombuffer(b, dtype=ckpt_bench.torch.uint8).data_ptr()
        spans.append((start, start + len(b)))
    got = made_before.load(path, pool)
    ckpt_bench.check_state(got, shapes, made_before.name)
    large = [k for k, t in got.items() if t.nbytes >= serialization.PREFETCH_OWN_BYTES]
    assert large == ["a", "c", "d"]
    for k in large:
        p = got[k].data_ptr()
        assert any(a <= p < e for a, e in spans), k
    assert sum(map(len, pool.values())) == 1  # the small tensor's block, unused
    assert prefetch._payload_memory is original
    again = deepnvme.load(path)
    assert not any(a <= again["a"].data_ptr() < e for a, e in spans)


def resident_pages(block: mmap.mmap) -> list[bool]:
    """Which of the mapping's pages are in memory (mincore(2)): the zero page counts, so see anon_bytes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-len(block) // mmap.PAGESIZE)
    out = ctypes.create_string_buffer(pages)
    view = ckpt_bench.torch.frombuffer(block, dtype=ckpt_bench.torch.uint8)
    if libc.mincore(view.data_ptr(), len(block), out) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return [bool(b & 1) for b in out.raw]


def anon_bytes() -> int:
    """This process's resident anonymous memory (RssAnon): pages it made, not the shared zero page."""
    return _harness.status_bytes("RssAnon")["RssAnon"]


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("threads", [None, 1, 2, 3])
def test_the_memory_only_references_make_every_page_of_the_state_dicts_bytes(
        threads: int | None, huge: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows that read nothing make the state dict's bytes of memory: their mapping starts with no page
    made, and after it every page is in memory and written (counted in RssAnon, which a read-only fault of
    the zero page is not), however the shares fall between threads and however many calls each share takes
    (a size that is no multiple of a page, of the thread count or of the call's size)."""
    from deepnvme._core import memory

    monkeypatch.setattr(memory, "POPULATE_CHUNK_BYTES", 3 * mmap.PAGESIZE)
    shapes = [("a", (300, 1001)), ("b", (7,)), ("c", (1000, 1000))]
    block = ckpt_bench.unmade_memory(shapes, huge)
    assert len(block) == ckpt_bench.nbytes_of(shapes)
    assert not any(resident_pages(block))
    before = anon_bytes()
    ckpt_bench.make_memory(block, threads)
    assert all(resident_pages(block))
    assert anon_bytes() - before >= len(block) - (1 << 20)  # slack: other threads' counters lag a little


def test_both_memory_rows_run_here_and_a_refusal_is_an_error_naming_the_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """This kernel has both advices (Linux 5.14+ with THP), so both rows are measured; where the kernel
    refuses, make_memory raises rather than report memory it did not make, and the row is left out."""
    from deepnvme._core import memory

    rows = ckpt_bench.memory_rows()
    assert [r.name for r in rows] == [ckpt_bench.MEMORY_ONLY, ckpt_bench.MEMORY_ONLY_HUGE]
    shapes = [("a", (1000, 1000))]
    for row in rows:
        block = row.prepare(shapes)
        assert row.load(Path("unused"), block) is None and all(resident_pages(block))
    monkeypatch.setattr(memory, "madvise", lambda address, nbytes, advice: errno.EINVAL)
    with pytest.raises(RuntimeError, match="MADV_POPULATE_WRITE.*refused"):
        ckpt_bench.make_memory(ckpt_bench.unmade_memory(shapes), 2)
    assert ckpt_bench.memory_rows() == []


def test_every_load_only_contender_but_the_memory_rows_reads_a_file_written_just_before() -> None:
    """Every contender that loads without saving writes its file again first (the rows that read nothing
    need none)."""
    load_only = [c for c in ckpt_bench.contenders(None, True) if c.save is None and c.load is not None]
    assert load_only
    for c in load_only:
        if c.name in (ckpt_bench.MEMORY_ONLY, ckpt_bench.MEMORY_ONLY_HUGE):
            assert c.rewrite is None, c.name
        else:
            assert c.rewrite is not None, c.name


def test_a_load_only_reference_reads_a_file_written_just_before_its_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference with `rewrite` loads a file written again after the saving contender's load, the old one
    removed first, off the clock and before the file is evicted; one without reads the file as it is."""
    events: list[Any] = []

    def save(sd: dict, path: Path) -> None:
        path.write_bytes(b"first")

    def rewrite(sd: dict, path: Path) -> None:
        events.append(("rewrite", path.exists()))
        path.write_bytes(b"again")

    def load(path: Path, given: Any) -> None:
        events.append(("load", path.read_bytes()))

    real_evict, real_timed = ckpt_bench.evict, ckpt_bench.timed

    def evict(path: Path) -> None:
        events.append("evict")
        real_evict(path)

    def timed(fn: Any) -> Any:
        events.append("clock on")
        try:
            return real_timed(fn)
        finally:
            events.append("clock off")

    monkeypatch.setattr(ckpt_bench, "evict", evict)
    monkeypatch.setattr(ckpt_bench, "timed", timed)
    saving = ckpt_bench.Contender("saves", save, load, "k")
    again = ckpt_bench.Contender("rewrites", None, load, "k", group="reference", rewrite=rewrite)
    plain = ckpt_bench.Contender("reads", None, load, "k", group="reference")
    saved: dict[str, Path] = {}
    for c in (saving, again, plain):
        ckpt_bench.measure(c, {}, [], tmp_path, False, 0.0, saved, None)
    load = ["evict", "clock on", "clock off"]
    saved_first = ["clock on", "clock off"]  # the saving contender's timed save
    assert [e for e in events if not isinstance(e, tuple)] == saved_first + load + load + load
    assert [e for e in events if isinstance(e, tuple)] == [
        ("load", b"first"), ("rewrite", False), ("load", b"again"), ("load", b"again")]
    at = events.index(("rewrite", False))
    assert events[at - 1] == "clock off" and events[at + 1:at + 3] == ["evict", "clock on"]
