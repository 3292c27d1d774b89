"""The prebuild path: DS_BUILD_* parsing and failures, and a DS_BUILD_AIO=1 wheel used from a fresh venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builder_helpers import REPO_ROOT

pytest.importorskip("torch")

_SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.o",
                               "_installed_ops.py", ".pytest_cache", ".ruff_cache", ".hypothesis",
                               "_bench_out")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the source tree, so builds never write into the working tree others use."""
    dest = tmp_path_factory.mktemp("src") / "deepnvme"
    shutil.copytree(REPO_ROOT, dest, ignore=_SKIP)
    return dest


def _pip_wheel(tree: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                           "--no-index", "-w", str(out), str(tree)], capture_output=True, text=True,
                          env={**clean, **env, "PIP_NO_INPUT": "1"}, timeout=900)


def test_ds_build_value_must_be_boolean(tree, tmp_path):
    res = _pip_wheel(tree, tmp_path, DS_BUILD_AIO="maybe")
    assert res.returncode != 0
    assert "DS_BUILD_AIO='maybe' is not a boolean" in res.stdout + res.stderr


def test_explicitly_requested_incompatible_op_fails_the_build(tree, tmp_path):
    import torch

    if torch.version.cuda is not None:
        pytest.skip("gds may be buildable with a CUDA torch")
    res = _pip_wheel(tree, tmp_path, DS_BUILD_GDS="yes")
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "DS_BUILD_GDS=1 asks for op 'gds' cannot be built here" in out
    assert "CPU-only" in out and "fix:" in out


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a wheel of async_io without ninja's parallel build, then a fresh venv
def test_prebuilt_async_io_wheel_in_a_fresh_venv(tree, tmp_path):
    if not (tree / "csrc" / "aio" / "py_aio.cpp").exists():
        pytest.skip("csrc/aio is not written yet")
    dist = tmp_path / "dist"
    res = _pip_wheel(tree, dist, DS_BUILD_AIO="1")
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    (wheel,) = dist.glob("deepnvme-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")  # must stay empty: nothing is JIT-built
    probe = (
        "import deepnvme, op_builder\n"
        "from op_builder import AsyncIOBuilder\n"
        "from op_builder.builder import csrc_root\n"
        "m = AsyncIOBuilder().load()\n"
        "print(m.__name__, deepnvme.__file__, op_builder.__file__, csrc_root(), hasattr(m, 'aio_handle'))\n")
    run = subprocess.run([str(py), "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    name, dn_file, ob_file, csrc, has_handle = run.stdout.split()
    assert name == "deepnvme.ops.async_io_op" and has_handle == "True"
    assert dn_file.startswith(str(venv)) and ob_file.startswith(str(venv))
    # The C++ sources travel inside the package, so JIT builds work from an installed copy too.
    assert csrc.startswith(str(venv)) and Path(csrc, "aio", "py_aio.cpp").is_file()
    assert not (tmp_path / "ext").exists()
