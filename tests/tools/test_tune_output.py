"""What the tuner shows: a progress line in the summary's words and figures, and a chart or a line saying why
there is none. Real searches on tiny files; the missing-matplotlib case runs the tool in a child process
with an import blocker first on its sys.path."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme.tools import tune

ROOT = Path(__file__).resolve().parents[2]
SWEEP = '{"block_size": ["256K", "1M"], "queue_depth": [4, 16]}'
FIGURES = r"\(GB/sec\): read = (n/a|\d+\.\d\d), write = (n/a|\d+\.\d\d)"


def tune_args(tmp_path: Path, *extra: str) -> list[str]:
    """A search small enough for seconds: 1 MiB per loop, four configurations, no fio."""
    return ["--nvme_dir", str(tmp_path), "--io_size", "1M", "--log_dir", str(tmp_path / "logs"),
            "--sweep_config", SWEEP, "--no_fio", "--time_budget", "20", *extra]


def leader_figures(results: list[dict], ops: tuple[str, ...]) -> tuple[str, ...]:
    """The figures the summary reports, worked out again from results.json: the configuration with the best
    median score among those measured at least twice (else among all), its median per operation."""
    runs: dict[str, list[dict]] = {}
    for r in results:
        runs.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r)
    pool = [k for k, v in runs.items() if len(v) >= 2] or list(runs)
    best = max(pool, key=lambda k: statistics.median(r["score"] for r in runs[k]))
    return tuple(f"{statistics.median(r[op] for r in runs[best]):.2f}" if op in ops else "n/a"
                 for op in ("read", "write"))


@pytest.mark.parametrize("extra, ops", [([], ("read", "write")), (["--no_read"], ("write",))],
                         ids=["read+write", "write-only"])
def test_progress_line_speaks_the_summarys_terms(extra: list[str], ops: tuple[str, ...], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """Every progress refresh shows read and write as the summary does, and the last one shows the summary's
    figures; with matplotlib the chart is drawn."""
    pytest.importorskip("tqdm")  # the progress line is tqdm's (the "tune" extra); the "test" extra has it
    rc = tune.main(tune_args(tmp_path, *extra))
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = re.search(rf"^Best performance {FIGURES}  \(", out, re.M)
    assert summary, out
    progress = re.findall(rf"best so far {FIGURES}", err)
    results = json.loads((tmp_path / "logs" / "results.json").read_text())["results"]
    assert len(progress) >= len(results) >= 4  # a refresh per measurement at least
    assert progress[-1] == summary.groups() == leader_figures(results, ops)
    assert all(p[0] == "n/a" for p in progress) == ("read" not in ops)
    assert "best so far" not in out  # the bar is on stderr, the summary on stdout
    if extra:
        return
    pytest.importorskip("matplotlib")
    chart = tmp_path / "logs" / "chart.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.rstrip().endswith("(with chart.png)") and "matplotlib" not in out + err


def test_missing_matplotlib_is_said_with_how_to_get_it(tmp_path: Path) -> None:
    """Without matplotlib the run still succeeds, and says why there is no chart and what installs it."""
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("matplotlib is blocked for this test")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker.parent), str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "deepnvme", "tune", *tune_args(tmp_path), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "chart" not in record and not (tmp_path / "logs" / "chart.png").exists()
    said = [ln for ln in proc.stderr.splitlines() if "chart.png not drawn" in ln]
    assert len(said) == 1, proc.stderr
    assert "matplotlib is not installed" in said[0]
    assert "pip install matplotlib" in said[0] and "pip install 'deepnvme[plot]'" in said[0]
    assert all((tmp_path / "logs" / name).is_file() for name in ("results.json", "best_config.json"))
