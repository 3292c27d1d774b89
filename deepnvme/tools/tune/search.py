"""The coarse-to-fine coordinate search with a time budget, early stopping and a confirmation round."""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from deepnvme.tools.sizes import format_size

from .bench import Bench
from .space import START, product

__all__ = ["GAIN", "Search", "best_line", "describe"]

GAIN = 1.03  # a pass must beat the leader by this factor to count as progress


class Search:
    """Coarse-to-fine coordinate search with a time budget, a progress bar and a log."""

    def __init__(self, bench: Bench, space: dict[str, list], budget: float, log: Callable[[str], None],
                 exhaustive: bool, fine: dict[str, list] | None = None) -> None:
        self.bench, self.space, self.budget, self.log = bench, space, budget, log
        self.exhaustive = exhaustive
        self.fine = fine or {}  # values the fine stage may try around the coarse winners
        self.results: list[dict] = []  # every measurement, in order
        self.by_key: dict[str, list[dict]] = {}
        self.start = time.monotonic()
        self.bar = _progress(self._estimate())

    def _estimate(self) -> int:
        """Evaluations the plan expects (the bar's total; early stopping may finish sooner)."""
        if self.exhaustive:
            return product(self.space) + 12
        return sum(len(v) for v in self.space.values()) * 2 + 16

    @staticmethod
    def key(config: dict) -> str:
        """A stable text key for a configuration."""
        return json.dumps(config, sort_keys=True)

    def left(self) -> float:
        """Seconds of budget left."""
        return self.budget - (time.monotonic() - self.start)

    def best(self, confirmed: bool = False) -> tuple[dict, dict] | None:
        """(config, median result) with the highest median score; `confirmed`: among re-measured ones."""
        pool = [k for k in self.by_key if len(self.by_key[k]) >= 2] if confirmed else list(self.by_key)
        if not pool:
            return None
        key = max(pool, key=lambda k: statistics.median(r["score"] for r in self.by_key[k]))
        runs = self.by_key[key]
        med = {m: statistics.median(r[m] for r in runs) for m in ("score", "write", "read") if m in runs[0]}
        return json.loads(key), med

    def leader(self) -> tuple[dict, dict] | None:
        """The configuration the search would pick now: the best re-measured one when there is one, since a
        single lucky sample must not beat configurations that held up when measured again."""
        return self.best(confirmed=True) or self.best()

    def score(self, config: dict, again: bool = False) -> float | None:
        """The config's median score, measuring it unless known (or `again`); None once over budget."""
        k = self.key(config)
        if k in self.by_key and not again:
            return statistics.median(r["score"] for r in self.by_key[k])
        mean_cost = (time.monotonic() - self.start) / max(len(self.results), 1)
        if self.results and self.left() < mean_cost:
            return None
        lead = self.best()
        floor = 0.7 * lead[1]["score"] if lead else 0.0
        result = self.bench.measure(config, floor)
        result["config"] = config
        result["t"] = round(time.monotonic() - self.start, 2)
        self.results.append(result)
        self.by_key.setdefault(k, []).append(result)
        parts = [f"{op} {result[op]:.3f}" for op in ("write", "read") if op in result]
        self.log(f"{describe(config)} -> {', '.join(parts)} GB/sec ({result['engine']})")
        self.bar.update(1)
        # What the summary would print if the search ended now (the same pick, the same words).
        self.bar.set_postfix_str(f"best so far {best_line(self.leader()[1])}")
        return result["score"]

    def run(self) -> tuple[dict, dict]:
        """Search, then return the best (config, median result)."""
        try:
            if self.exhaustive:
                self._grid()
            else:
                self._coordinate()
            self._confirm()
        finally:
            self.bar.close()
        found = self.leader()
        if found is None:
            raise RuntimeError("the time budget ran out before one configuration was measured")
        return found

    def _grid(self) -> None:
        """Every point of a small space."""
        keys = list(self.space)
        for values in itertools.product(*(self.space[k] for k in keys)):
            if self.score({**START, **dict(zip(keys, values))}) is None:
                return

    def _coordinate(self) -> None:
        """One setting at a time over coarse values; passes until no gain; then the winners' neighbours."""
        current = {k: (self.space[k][0] if k in self.space and START[k] not in self.space[k] else START[k])
                   for k in START}
        if self.score(current) is None:
            return
        for _ in range(3):
            before = self.score(current)
            for dim in ("engine", "block_size", "queue_depth", "intra_op_parallelism", "overlap_events",
                        "single_submit"):
                for value in self.space.get(dim, []):
                    if value == current[dim]:
                        continue
                    better = self._step(current, dim, value)
                    if better is None:
                        return
                    current = better
            if self.score(current) < before * GAIN:
                break  # early stopping: a whole pass gained less than 3%
        for dim in ("block_size", "queue_depth"):
            if dim not in self.fine:
                continue
            for value in (current[dim] // 2, current[dim] * 2):
                if value in self.fine[dim] and value != current[dim]:
                    better = self._step(current, dim, value)
                    if better is None:
                        return
                    current = better

    def _step(self, current: dict, dim: str, value: object) -> dict | None:
        """`current` with `dim` set to `value` if that scores clearly better, else `current`; None once the
        budget is spent."""
        trial = {**current, dim: value}
        s = self.score(trial)
        if s is None:
            return None
        return trial if s > self.score(current) * GAIN else current

    def _confirm(self, top: int = 4, rounds: int = 3) -> None:
        """Measure the leaders again, round by round, while the budget lasts: noise must not decide."""
        ranked = sorted(self.by_key, key=lambda k: -statistics.median(r["score"] for r in self.by_key[k]))
        for _ in range(rounds):
            for k in ranked[:top]:
                if self.score(json.loads(k), again=True) is None:
                    return

class _NoBar:
    """Stands in for tqdm when it is not installed."""

    def update(self, n: int) -> None:
        """Nothing to draw."""

    def set_postfix_str(self, s: str) -> None:
        """Nothing to draw."""

    def close(self) -> None:
        """Nothing to close."""


def _progress(total: int) -> Any:
    """A tqdm bar on stderr, or nothing when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="tuning", unit="cfg", file=sys.stderr, leave=False, dynamic_ncols=True)


def best_line(med: dict) -> str:
    """The winner's figures as both the summary and the progress bar say them, e.g.
    '(GB/sec): read = 1.79, write = 2.75' (n/a for an operation not measured)."""
    figures = {op: f"{med[op]:.2f}" if op in med else "n/a" for op in ("read", "write")}
    return f"(GB/sec): read = {figures['read']}, write = {figures['write']}"


def describe(config: dict) -> str:
    """One line for a configuration, e.g. 'io_uring bs=1M qd=32 p=2 overlap single=no'."""
    return (f"{config['engine']} bs={format_size(config['block_size'])} qd={config['queue_depth']} "
            f"p={config['intra_op_parallelism']} {'overlap' if config['overlap_events'] else 'sequential'} "
            f"{'single' if config['single_submit'] else 'batch'}")
