"""A PNG bar chart of the measurements, when matplotlib is installed."""

from __future__ import annotations

from .search import describe

__all__ = ["MISSING", "chart"]

# What the tuner prints instead of drawing: matplotlib is an optional dependency (the "plot" extra).
MISSING = ("chart.png not drawn: matplotlib is not installed; `pip install matplotlib` "
           "(or deepnvme's plot extra, `pip install 'deepnvme[plot]'`) draws it on the next run")


def chart(results: list[dict], path: str) -> bool:
    """A PNG bar chart of GB/s per configuration; True when written, False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows: dict[str, dict] = {}
    for r in results:
        rows.setdefault(describe(r["config"]), r)  # the first measurement of each configuration
    ordered = sorted(rows.items(), key=lambda kv: kv[1]["score"])
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(ordered) + 1.5))
    names = [n for n, _ in ordered]
    left = [0.0] * len(ordered)
    for op in ("write", "read"):
        vals = [r.get(op, 0.0) for _, r in ordered]
        ax.barh(names, vals, left=left, label=op)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("GB/sec (1024^3), write + read")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
