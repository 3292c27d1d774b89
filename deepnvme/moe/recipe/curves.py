"""Validation-loss curves and the summary table of recipe runs (the --log-json files of deepnvme.moe.recipe).

matplotlib is needed only to draw (`pip install deepnvme[plot]`); the table needs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _label_check(runs: Mapping[str, Mapping[str, Any]]) -> None:
    if not runs:
        raise ValueError("runs is empty: nothing to draw")
    for label, run in runs.items():
        if not run.get("curve"):
            raise ValueError(f"run {label!r} has no curve points")


def plot_curves(runs: Mapping[str, Mapping[str, Any]], path: str, title: str = "") -> str:
    """Draw validation loss against iteration for every run (label -> results) into the PNG `path`.

    The task's loss floor (the same for every run of one task) is drawn as a dashed line.
    """
    _label_check(runs)
    if not str(path).endswith(".png"):
        raise ValueError(f"path must name a .png file, got {path!r}")
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    try:
        for label, run in runs.items():
            its = [p["iter"] for p in run["curve"]]
            ax.plot(its, [p["val_loss"] for p in run["curve"]], marker="o", markersize=2.5, label=label)
        floors = {round(run["loss_floor"], 6) for run in runs.values() if "loss_floor" in run}
        if len(floors) == 1:
            ax.axhline(
                floors.pop(), color="grey", linestyle="--", linewidth=1, label="loss floor of the task"
            )
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation loss (nats/token)")
        if title:
            ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return str(path)


def _millions(n: int) -> str:
    return f"{n / 1e6:.3f} M" if n >= 1e5 else f"{n / 1e3:.1f} k"


def _first_iter_at_or_below(run: Mapping[str, Any], loss: float) -> int | None:
    return next((p["iter"] for p in run["curve"] if p["val_loss"] <= loss), None)


def results_table(runs: Mapping[str, Mapping[str, Any]], baseline: str | None = None) -> str:
    """A markdown table: parameters (total, active per token), validation loss half-way and at the end,
    distance to the task's floor, train time.

    With `baseline` (a label of `runs`): each run's distance to the floor relative to the baseline's, and the
    first iteration at which the run's validation loss reached the baseline's final one.
    """
    _label_check(runs)
    if baseline is not None and baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not one of the runs {list(runs)}")
    head = ["run", "total params", "active params", "val loss half-way", "final val loss", "above floor"]
    if baseline:
        head += [f"vs {baseline} (above floor)", f"reaches {baseline}'s final loss at"]
    head.append("train time")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def gap(run: Mapping[str, Any]) -> float:
        return run["final_val_loss"] - run.get("loss_floor", 0.0)

    for label, run in runs.items():
        curve = run["curve"]
        half = min(curve, key=lambda p: abs(p["iter"] - curve[-1]["iter"] / 2))
        row = [label, _millions(run["params"]["total"]), _millions(run["params"]["active"]),
               f"{half['val_loss']:.4f} (iter {half['iter']})", f"{run['final_val_loss']:.4f}",
               f"{gap(run):.4f}"]
        if baseline:
            base = gap(runs[baseline])
            row.append(f"{gap(run) / base:.2f}×" if base > 0 and not math.isnan(base) else "n/a")
            reached = _first_iter_at_or_below(run, runs[baseline]["final_val_loss"])
            row.append("never" if reached is None else f"iter {reached}")
        row.append(f"{run.get('train_s', float('nan')):.0f} s")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
