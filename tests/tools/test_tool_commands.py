"""The commands keep working from their real paths: the console scripts pyproject.toml declares and
``python -m deepnvme.tools.<tool>`` (the bin/ launchers and ``deepnvme``: test_command.py); the old
top-level aliases are gone."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"deepnvme": "deepnvme.tools.command", "ds_report": "deepnvme.tools.report",
         "ds_io": "deepnvme.tools.ds_io", "ds_nvme_tune": "deepnvme.tools.tune"}
REMOVED = ("demo", "ds_io", "report", "tune", "pagecache", "pattern", "sizes", "fastio")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)


def test_console_scripts_point_at_the_tools() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(TOOLS)
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        assert module == TOOLS[name]
        assert callable(getattr(importlib.import_module(module), func))


@pytest.mark.parametrize("module", ["deepnvme.tools.report", "deepnvme.tools.ds_io", "deepnvme.tools.tune",
                                    "deepnvme.tools.demo"])
def test_python_m_runs_the_tool(module: str) -> None:
    run = _run([sys.executable, "-m", module, "--help"])
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout


def test_no_alias_modules_at_the_top() -> None:
    # Checked on the tree: an editable install elsewhere can still lend the interpreter its old files.
    assert [n for n in REMOVED if (ROOT / "deepnvme" / f"{n}.py").exists()] == []
    assert not (ROOT / "deepnvme" / "ops").exists()  # prebuilt ops land there at install time only
