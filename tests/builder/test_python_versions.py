"""The ops use only CPython's public C API, so their Python-facing sources compile against the headers of
every CPython that torch 2.13 supports (3.10-3.13) that this machine has, not only the one running the tests.

A full build and run needs torch for that Python; where only the headers are here, this compile-only check is
what can be shown: the sources are compiled with the builder's own flags against the running torch's headers
(torch's C++ and pybind11 headers do not depend on the Python version) and the other Python's headers."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUPPORTED = ((3, 10), (3, 11), (3, 12), (3, 13))  # the CPython versions torch 2.13 publishes wheels for
# Every source that includes Python.h or pybind11 (gds's binding is checked by test_gds_compile.py).
PY_SOURCES = ("csrc/aio/py_aio.cpp", "csrc/pin/py_pin.cpp", "csrc/aio/pinned.cpp")


def _interpreters() -> dict[tuple[int, int], str]:
    """One python3.X per supported version: on PATH, or under pyenv's versions folder."""
    found: dict[tuple[int, int], str] = {}
    roots = [os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")]
    for major, minor in SUPPORTED:
        name = f"python{major}.{minor}"
        candidates = [shutil.which(name), *sorted(glob.glob(os.path.join(roots[0], "versions",
                                                                         f"{major}.{minor}.*", "bin", name)))]
        for exe in filter(None, candidates):
            ok = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                text=True, timeout=60, check=False)
            if ok.returncode == 0 and ok.stdout.strip() == str((major, minor)):
                found[(major, minor)] = exe
                break
    return found


INTERPRETERS = _interpreters()


def _include_dir(exe: str) -> str:
    out = subprocess.run([exe, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def _compile_argv(python_include: str) -> list[str]:
    """The async_io builder's compile flags, -fsyntax-only, torch's includes, this Python's headers."""
    from torch.utils.cpp_extension import include_paths as torch_includes

    from op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    cxx = os.environ.get("CXX", "").strip() or "c++"
    defines = [a for a in builder.cxx_args() if a.startswith("-D")]
    flags = [a for a in builder.cxx_args() if a.startswith(("-W", "-f"))]
    return [shutil.which(cxx) or cxx, "-fsyntax-only", "-std=c++17", *flags, *defines,
            "-DTORCH_EXTENSION_NAME=deepnvme_async_io", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-I{REPO / 'csrc' / 'aio'}", *(f"-isystem{d}" for d in torch_includes()),
            f"-isystem{python_include}"]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)


def test_a_newer_python_is_checked() -> None:
    """At least one Python besides the running one is here, or the checks below test nothing new."""
    others = [v for v in INTERPRETERS if v != sys.version_info[:2]]
    if not others:
        pytest.skip("no other CPython 3.10-3.13 on this machine (PATH or pyenv)")
    assert max(others) >= (3, 12)


@pytest.mark.slow
@pytest.mark.parametrize("version", [v for v in SUPPORTED if v != sys.version_info[:2]],
                         ids=lambda v: f"py{v[0]}{v[1]}")
def test_python_facing_sources_compile(version: tuple[int, int]) -> None:
    """py_aio.cpp, py_pin.cpp and pinned.cpp compile against this Python's headers (CPython 3.13 removed the
    private _Py_IsFinalizing; the running Python's build is tested by every aio test)."""
    torch = pytest.importorskip("torch")
    del torch
    exe = INTERPRETERS.get(version)
    if exe is None:
        pytest.skip(f"python{version[0]}.{version[1]} is not installed here")
    include = _include_dir(exe)
    if not (Path(include) / "Python.h").is_file():
        pytest.skip(f"no Python.h under {include} (the python{version[0]}.{version[1]} headers)")
    argv = _compile_argv(include)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(_run, [[*argv, str(REPO / s)] for s in PY_SOURCES]))
    failures = [f"{src}:\n{r.stderr[-3000:]}" for src, r in zip(PY_SOURCES, results) if r.returncode != 0]
    assert not failures, "\n\n".join(failures)


def test_only_public_cpython_api() -> None:
    """No private CPython call (``_Py...``/``_PyObject...``) in the sources, except behind a version check
    for Pythons that have no public spelling of it."""
    offenders = []
    for path in sorted((REPO / "csrc").rglob("*.[ch]*")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            code = line.split("//")[0]
            if "_Py" not in code:
                continue
            guard = next((lines[j] for j in range(i - 1, max(i - 6, -1), -1) if lines[j].startswith("#")), "")
            if not (guard.startswith("#else") and "PY_VERSION_HEX" in "\n".join(lines[max(0, i - 6):i])):
                offenders.append(f"{path.relative_to(REPO)}:{i + 1}: {line.strip()}")
    assert not offenders, "private CPython API outside a version check:\n" + "\n".join(offenders)


@pytest.mark.parametrize("version", [max((v for v in SUPPORTED if v != sys.version_info[:2]), default=None)],
                         ids=lambda v: f"py{v[0]}{v[1]}" if v else "none")
def test_report_on_the_newest_python(version: tuple[int, int] | None) -> None:
    """ds_report runs on the newest other Python: with torch there, async_io is usable; without it (no CPU
    torch 2.13 wheel for it on this machine), torch is the one thing the op lacks, and the report says so."""
    exe = INTERPRETERS.get(version) if version else None
    if exe is None:
        pytest.skip("no other CPython 3.10-3.13 on this machine")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([exe, "-m", "deepnvme.tools.report", "--json"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300, check=False)
    report = json.loads(run.stdout)
    has_torch = subprocess.run([exe, "-c", "import torch"], capture_output=True, timeout=300).returncode == 0
    (aio,) = [op for op in report["ops"] if op["name"] == "async_io"]
    if has_torch:
        assert run.returncode == 0 and report["async_io_usable"], aio
    else:
        assert run.returncode == 1 and not report["async_io_usable"]
        assert aio["reason"].count("->") == 1 and "torch is not installed" in aio["reason"], aio["reason"]
