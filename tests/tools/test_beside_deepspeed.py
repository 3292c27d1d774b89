"""deepnvme and DeepSpeed 0.19.8 installed into one environment, in both orders, as a user would: the
`deepnvme` command always runs ours, and each ds_* name runs what README's "Beside DeepSpeed" table says for
that order; the commands our first line names for DeepSpeed's tools run DeepSpeed's.

Each environment is a fresh venv with --system-site-packages, so torch 2.13.0 comes from the system and pip
never resolves torch: deepnvme goes in from a copy of this tree (non-editable, --no-build-isolation --no-deps)
and DeepSpeed from PyPI with --no-deps plus the packages it needs to import, none of which depends on torch.
The system's editable deepnvme is visible there too, behind the venv's own install; each test checks that the
venv's copy is the one that runs. Needs PyPI (or pip's cache) for DeepSpeed and its few dependencies.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme._version import __version__

pytest.importorskip("torch")  # from the system site packages, into both venvs

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = "deepspeed==0.19.8"
# What DeepSpeed 0.19.8 needs to import (its requirements less torch, which the system provides).
DEEPSPEED_NEEDS = ["einops", "hjson", "msgpack", "ninja", "numpy", "packaging", "psutil", "py-cpuinfo",
                   "pydantic>=2", "tqdm"]
ORDERS = {"deepnvme-then-DeepSpeed": ("deepnvme", "DeepSpeed"),
          "DeepSpeed-then-deepnvme": ("DeepSpeed", "deepnvme")}
SHARED = {"ds_report": "report", "ds_io": "io", "ds_nvme_tune": "tune"}
_SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.o",
                               "_installed_ops.py", ".pytest_cache", ".ruff_cache", ".hypothesis",
                               "_bench_out", "tests", "bench")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two venvs and ~10 DeepSpeed imports, ~2 min


def clean_env(venv: Path) -> dict[str, str]:
    """The user's shell after `source venv/bin/activate`: the venv's scripts first, no PYTHONPATH (the tests
    run with this tree on it, which would shadow the venv's install)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", NO_COLOR="1")
    return env


class Venv:
    """A venv and the commands run in it, from a directory of its own (never this tree)."""

    def __init__(self, path: Path, tree: Path) -> None:
        self.path, self.tree = path, tree
        self.cwd = path.parent / f"{path.name}-cwd"
        self.cwd.mkdir()
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)],
                       check=True, timeout=300)

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A command as typed in the activated venv (the first word is looked up on its PATH)."""
        env = clean_env(self.path)
        exe = shutil.which(args[0], path=env["PATH"]) or args[0]
        return subprocess.run([exe, *args[1:]], cwd=self.cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def pip(self, *args: str) -> None:
        """The system's pip aimed at this venv's interpreter; a failure fails the test with pip's output."""
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.path / "bin" / "python"),
                               *args], cwd=self.cwd, env=clean_env(self.path), capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, f"pip {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"

    def install(self, package: str, *extra: str) -> None:
        """Install deepnvme (this tree, as a user's clone) or DeepSpeed (PyPI, torch left alone)."""
        if package == "deepnvme":
            self.pip("install", "--no-build-isolation", "--no-deps", *extra, str(self.tree))
        else:
            self.pip("install", "--no-deps", *extra, DEEPSPEED)
            self.pip("install", *DEEPSPEED_NEEDS)

    def script(self, name: str) -> str:
        """The text of a console script in the venv ('' when there is none)."""
        path = self.path / "bin" / name
        return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Venv]:
    """Both orders, built once for the module."""
    base = tmp_path_factory.mktemp("beside")
    tree = base / "deepnvme"
    shutil.copytree(ROOT, tree, ignore=_SKIP)
    built = {}
    for name, order in ORDERS.items():
        venv = Venv(base / name, tree)
        for package in order:
            venv.install(package)
        built[name] = venv
    return built


def readme_owner(last: str) -> str:
    """Whose ds_* tools README's "Beside DeepSpeed" table says run when `last` was installed last."""
    section = (ROOT / "README.md").read_text().split("\n## Beside DeepSpeed\n", 1)[1].split("\n## ", 1)[0]
    row = next(ln for ln in section.splitlines() if ln.startswith(f"| {last} |"))
    return row.split("|")[2].strip().split("'")[0]


def our_first_line(prog: str, shared_name: str) -> str:
    """What a run of ours starts with where DeepSpeed is importable (the DeepSpeed command is checked by
    running it, in test_the_deepspeed_commands_we_print_run_deepspeeds_tools)."""
    return f"{prog} (deepnvme {__version__}); DeepSpeed's {shared_name}: python "


def deepspeed_command(text: str, shared_name: str) -> list[str]:
    """The command for DeepSpeed's tool that a first line of ours names."""
    line = next(ln for ln in text.splitlines() if f"; DeepSpeed's {shared_name}: " in ln)
    return shlex.split(line.split(f"; DeepSpeed's {shared_name}: ", 1)[1])


def assert_ours(proc: subprocess.CompletedProcess[str], shared_name: str) -> None:
    """The run was deepnvme's tool and said so: first for a real run, in the description for --help."""
    assert proc.returncode in (0, 1), (proc.stdout + proc.stderr)[-3000:]
    if proc.stdout.startswith("usage: "):
        assert f"\n{our_first_line(shared_name, shared_name)}" in proc.stdout, proc.stdout
    else:
        assert proc.stdout.startswith(our_first_line(shared_name, shared_name)), proc.stdout[:500]


def assert_deepspeeds(proc: subprocess.CompletedProcess[str], shared_name: str) -> None:
    """The run was DeepSpeed's tool: its own output, none of ours."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "(deepnvme " not in out
    marks = {"ds_report": "DeepSpeed C++/CUDA extension op report", "ds_io": "--folder_to_device_mapping",
             "ds_nvme_tune": "--nvme_dir"}
    ours_only = {"ds_report": "deepnvme I/O capabilities", "ds_io": "--io_engine",
                 "ds_nvme_tune": "--time_budget"}
    assert marks[shared_name] in out and ours_only[shared_name] not in out, out[-3000:]


@pytest.mark.parametrize("order", ORDERS)
def test_the_venvs_own_deepnvme_runs_with_the_systems_torch(venvs: dict[str, Venv], order: str) -> None:
    venv = venvs[order]
    code = ("import deepnvme, torch, deepspeed\n"
            "print(deepnvme.__file__, torch.__file__, deepspeed.__version__)")
    proc = venv.run("python", "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deepnvme_file, torch_file, deepspeed_version = proc.stdout.split()[-3:]
    assert deepnvme_file.startswith(str(venv.path)), "the system's editable deepnvme shadowed the venv's"
    assert not torch_file.startswith(str(venv.path)), "pip installed a torch into the venv"
    assert deepspeed_version == DEEPSPEED.split("==")[1]


@pytest.mark.parametrize("order", ORDERS)
def test_deepnvme_command_always_runs_ours(venvs: dict[str, Venv], order: str) -> None:
    venv = venvs[order]
    for argv in (["deepnvme", "report"], ["python", "-m", "deepnvme", "report"]):
        proc = venv.run(*argv, "--json", "--dir", str(venv.cwd))
        assert proc.returncode in (0, 1), proc.stderr[-3000:]
        doc = json.loads(proc.stdout)
        assert doc["tool"]["command"] == "deepnvme report" and doc["tool"]["package"] == "deepnvme"
        assert doc["tool"]["deepspeed_command"] == "python -m deepspeed.env_report"
        assert all(p.startswith(str(venv.path)) for p in doc["environment"]["deepnvme_install_path"])
        assert proc.stderr.startswith(our_first_line("deepnvme report", "ds_report"))
        text = venv.run(*argv, "--dir", str(venv.cwd))
        assert text.stdout.startswith(our_first_line("deepnvme report", "ds_report")), text.stdout[:500]
    for sub, shared_name in (("io", "ds_io"), ("tune", "ds_nvme_tune")):
        helped = venv.run("deepnvme", sub, "--help")
        assert helped.returncode == 0 and f"usage: deepnvme {sub}" in helped.stdout, helped.stderr
        assert our_first_line(f"deepnvme {sub}", shared_name) in helped.stdout


@pytest.mark.parametrize("order", ORDERS)
def test_ds_names_belong_to_the_package_installed_last(venvs: dict[str, Venv], order: str) -> None:
    venv = venvs[order]
    owner = readme_owner(ORDERS[order][-1])
    assert owner in ("DeepSpeed", "deepnvme"), owner
    for shared_name in SHARED:
        if shared_name != "ds_report":
            args = ["--help"]
        else:  # a real report; DeepSpeed's takes only its two --hide flags
            args = ["--dir", str(venv.cwd)] if owner == "deepnvme" else []
        proc = venv.run(shared_name, *args)
        if owner == "deepnvme":
            assert_ours(proc, shared_name)
        else:
            assert_deepspeeds(proc, shared_name)


def test_the_deepspeed_commands_we_print_run_deepspeeds_tools(venvs: dict[str, Venv]) -> None:
    """Where deepnvme owns the ds_* names, the command our first line names (and DeepSpeed's `dsr`) runs
    DeepSpeed's tool."""
    venv = venvs["DeepSpeed-then-deepnvme"]
    for shared_name in SHARED:
        ours = venv.run(shared_name, "--help")
        assert ours.returncode == 0, ours.stderr[-3000:]
        command = deepspeed_command(ours.stdout, shared_name)
        args = [] if shared_name == "ds_report" else ["--help"]
        assert_deepspeeds(venv.run(*command, *args), shared_name)
    assert_deepspeeds(venv.run("dsr"), "ds_report")


def test_reinstalling_or_uninstalling_moves_the_names(venvs: dict[str, Venv]) -> None:
    """README: reinstall a package last to hand it the names; uninstalling the owner removes them, and
    reinstalling the other brings its back. Ends as it began (deepnvme last)."""
    venv = venvs["DeepSpeed-then-deepnvme"]

    def owners() -> set[str]:
        found = set()
        for name in SHARED:
            text = venv.script(name)
            found.add("deepnvme" if "deepnvme.tools" in text else "DeepSpeed" if "deepspeed" in text else "")
        return found

    assert owners() == {"deepnvme"}
    venv.pip("install", "--force-reinstall", "--no-deps", DEEPSPEED)  # README's command, as written there
    assert owners() == {"DeepSpeed"}
    venv.pip("uninstall", "-y", "deepspeed")
    assert owners() == {""} and "deepnvme.tools.command" in venv.script("deepnvme")
    venv.install("deepnvme", "--force-reinstall")
    assert owners() == {"deepnvme"}
    # Without DeepSpeed our first line names no DeepSpeed command, and the JSON field holds null.
    alone = venv.run("ds_report", "--json", "--dir", str(venv.cwd))
    assert alone.stderr.splitlines()[0] == f"ds_report (deepnvme {__version__})", alone.stderr[-3000:]
    assert json.loads(alone.stdout)["tool"]["deepspeed_command"] is None
    venv.pip("install", "--no-deps", DEEPSPEED)
    venv.install("deepnvme", "--force-reinstall")
    assert owners() == {"deepnvme"}
