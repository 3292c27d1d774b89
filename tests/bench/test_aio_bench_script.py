"""bench/aio_bench.py: its scheduler interleaves as it says, and a tiny run gives the handle and fio the same
grid on one file whose layout never changes. Nothing here is timed: the figures
of a 4 MiB run mean nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import aio_bench  # noqa: E402


def test_measure_rotates_contenders_and_reverses_heats() -> None:
    order: list[str] = []

    def case(name: str) -> aio_bench.Case:
        return aio_bench.Case("g", name, "write", lambda: (order.append(name), (1.0, 0.0))[1], 1)

    heats = [[case("a1"), case("a2"), case("a3")], [case("b1"), case("b2"), case("b3")]]
    aio_bench.measure(heats, 3, 0.0, lambda _msg: None)
    assert order == ["a1", "a2", "a3", "b1", "b2", "b3",  # repeat 1
                     "b2", "b3", "b1", "a2", "a3", "a1",  # repeat 2: heats reversed, contenders rotated
                     "a3", "a1", "a2", "b3", "b1", "b2"]
    assert all(len(c.samples) == 3 for heat in heats for c in heat)


def test_grid_is_the_issues_grid() -> None:
    points = {(s.block, s.depth, s.jobs) for s in aio_bench.grid()}
    assert points == {(b << 20, d, j) for b in (1, 8) for d in (32, 128) for j in (1, 2)}
    assert aio_bench.target_for(64 << 20) == 0.8 and aio_bench.target_for(256 << 20) == 0.9
    assert aio_bench.target_for(1 << 30) == 0.95 and aio_bench.target_for(4 << 30) == 0.95
    assert aio_bench.target_for(16 << 20) is None


def test_bad_sections_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        aio_bench.parse_args(["--sections", "grid,colour"])
    assert exc.value.code == 2 and "--sections" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (.ci/setup installs it)")
def test_tiny_run_same_grid_same_file(tmp_path: Path) -> None:
    out = tmp_path / "res"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "aio_bench.py"), "--dir", str(tmp_path),
                           "--sizes", "4M", "--repeats", "1", "--sections", "grid", "--rest", "0",
                           "--engines", "libaio", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    cases = data["cases"]
    assert len(cases) == 8 * 2 * 3  # grid points x ops x (locked, plain, fio)
    for c in cases:
        assert len(c["samples"]) == 1 and c["layout_changes"] == 0 and c["bytes"] == 4 << 20
    by = {(c["group"], c["name"], c["op"], c["setting"]) for c in cases}
    for s in aio_bench.grid():
        for op in ("write", "read"):
            for who in (("deepnvme", "libaio locked"), ("deepnvme", "libaio plain"), ("fio", "libaio")):
                assert (*who, op, s.label()) in by
    size = data["sizes"][0]
    for op in ("write", "read"):
        assert size[op]["ratio"] == pytest.approx(size[op]["best_deepnvme"] / size[op]["best_fio"])
        assert len(size[op]["same_settings"]) == 8
        assert set(size[op]["plain_over_locked"]) == {"1M", "8M"}
    report = out.with_suffix(".md").read_text()
    assert "## Summary" in report and "leaves out its file open" in report
    assert report.count("WARNING") == len(size["warnings"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("aio_bench_")]  # scratch removed
