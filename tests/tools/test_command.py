"""The deepnvme command: subcommands with their tools' options and exit codes, and a first line (and a JSON
field) on every run that says the tool is deepnvme's. Each case runs the real command in a fresh process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme._version import __version__

ROOT = Path(__file__).resolve().parents[2]
# subcommand -> the name DeepSpeed shares, and the command our first line gives for DeepSpeed's tool
SHARED = {"report": "ds_report", "io": "ds_io", "tune": "ds_nvme_tune"}
DEEPSPEED_HERE = importlib.util.find_spec("deepspeed") is not None


def run(args: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """A command in a fresh process with this tree first on sys.path, from `cwd` (never the tree itself)."""
    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(args, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout,
                          check=False)


def deepnvme(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m deepnvme ARGS``."""
    return run([sys.executable, "-m", "deepnvme", *args], cwd, timeout)


def first_line(prog: str, shared_name: str | None) -> str:
    """The line a run of ours starts with, written out here rather than taken from the code under test."""
    line = f"{prog} (deepnvme {__version__})"
    if shared_name and DEEPSPEED_HERE:
        line += f"; DeepSpeed's {shared_name}: "  # the command itself is checked in test_beside_deepspeed.py
    return line


def test_help_lists_the_subcommands_without_importing_torch(tmp_path: Path) -> None:
    code = ("import sys\nfrom deepnvme.tools.command import main\nrc = main(['--help'])\n"
            "print('torch' in sys.modules, rc)")
    proc = run([sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False 0"
    helped = deepnvme("--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    for sub, shared in [*SHARED.items(), ("demo", "")]:
        assert re.search(rf"^  {sub} +{shared} +\S", helped.stdout, re.M), helped.stdout
    for argv in ([sys.executable, "-m", "deepnvme"], [sys.executable, str(ROOT / "bin" / "deepnvme")]):
        version = run([*argv, "--version"], tmp_path)
        assert (version.returncode, version.stdout) == (0, f"deepnvme {__version__}\n")


@pytest.mark.parametrize("args, says", [([], "a subcommand is required"),
                                        (["nope"], "unknown subcommand 'nope'"),
                                        (["--json"], "unknown subcommand '--json'")])
def test_missing_or_unknown_subcommand_exits_2(args: list[str], says: str, tmp_path: Path) -> None:
    proc = deepnvme(*args, cwd=tmp_path)
    assert proc.returncode == 2 and f"deepnvme: error: {says}" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("sub", SHARED)
def test_subcommand_help_is_the_tools_help(sub: str, tmp_path: Path) -> None:
    """The same options as the ds_* launcher in bin/: the two helps differ only in the command's name."""
    ours = deepnvme(sub, "--help", cwd=tmp_path)
    shared = run([sys.executable, str(ROOT / "bin" / SHARED[sub]), "--help"], tmp_path)
    assert ours.returncode == shared.returncode == 0, ours.stderr + shared.stderr
    assert f"usage: deepnvme {sub} " in ours.stdout
    assert first_line(f"deepnvme {sub}", SHARED[sub]) in ours.stdout
    assert first_line(SHARED[sub], SHARED[sub]) in shared.stdout

    def words(text: str) -> list[str]:
        # argparse wraps the usage by the name's length; the docstring under it may name the tool too.
        return text.replace(f"deepnvme {sub}", "PROG").replace(SHARED[sub], "PROG").split()
    assert words(ours.stdout) == words(shared.stdout)


@pytest.mark.parametrize("args, name", [
    (["report", "--no_such_flag"], "unrecognized arguments: --no_such_flag"),
    (["io", "--io_size", "4X"], "argument --io_size"),
    (["io", "--folder", "/nonexistent/dir", "--io_size", "1M"], "/nonexistent/dir"),
    (["tune", "--nvme_dir", "/nonexistent/dir"], "argument --nvme_dir"),
    (["tune", "--nvme_dir", ".", "--loops", "0"], "argument --loops"),
    (["demo", "--size", "1X"], "argument --size"),
    (["demo", "--dir", "/nonexistent/dir"], "argument --dir"),
])
def test_bad_arguments_exit_2_as_the_tools_do(args: list[str], name: str, tmp_path: Path) -> None:
    proc = deepnvme(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert name in proc.stderr


def test_report_first_line_json_field_and_exit_status(tmp_path: Path) -> None:
    """`deepnvme report` is ds_report under our name: the same document and status, its own first line."""
    text = deepnvme("report", "--dir", str(tmp_path), cwd=tmp_path)
    lines = text.stdout.splitlines()
    assert lines[0].startswith(first_line("deepnvme report", "ds_report")), lines[0]
    assert lines[1] == "-" * 50 and "extension op report" in lines[2]
    ours = deepnvme("report", "--json", "--dir", str(tmp_path), cwd=tmp_path)
    shared = run([sys.executable, str(ROOT / "bin" / "ds_report"), "--json", "--dir", str(tmp_path)],
                 tmp_path)
    assert ours.returncode == shared.returncode == text.returncode
    assert ours.returncode in (0, 1), ours.stderr
    doc, theirs = json.loads(ours.stdout), json.loads(shared.stdout)
    assert ours.stderr.splitlines()[0].startswith(first_line("deepnvme report", "ds_report"))
    assert doc["tool"]["command"] == "deepnvme report" and theirs["tool"]["command"] == "ds_report"
    for tool in (doc["tool"], theirs["tool"]):
        assert tool["package"] == "deepnvme" and tool["version"] == __version__
        assert (tool["deepspeed_command"] is not None) == DEEPSPEED_HERE
    assert doc["async_io_usable"] == theirs["async_io_usable"] == (ours.returncode == 0)
    assert doc["environment"]["deepnvme_install_path"] == [str(ROOT / "deepnvme")]


def test_io_under_python_m_spawns_its_workers(tmp_path: Path) -> None:
    """Two spawned processes under `python -m deepnvme io`: deepnvme/__main__.py must not run the command
    again when a worker imports it as __mp_main__."""
    folder = tmp_path / "io"
    folder.mkdir()
    proc = deepnvme("io", "--folder", str(folder), "--io_size", "4M", "--multi_process", "2", "--loops", "1",
                    "--json", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert rec["processes"] == 2 and rec["requests"] == 2
    assert rec["tool"]["command"] == "deepnvme io" and rec["tool"]["package"] == "deepnvme"
    err = proc.stderr.splitlines()
    assert err[0].startswith(first_line("deepnvme io", "ds_io"))
    assert err[1] == "Testing DeepNVMe python frontend"
    assert err.count(err[0]) == 1  # one banner: no worker ran the command


def test_demo_first_line(tmp_path: Path) -> None:
    proc = deepnvme("demo", "--size", "4M", "--dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == first_line("deepnvme demo", None)
