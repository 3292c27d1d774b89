"""The C++ unit tests (tests/cpp/*.cpp): the pure functions of the I/O core (request planning, the tunables'
parser, the staging share, the short-transfer continuation rule) and the request pipeline's hand-over rules
(driven by hand, without an engine), compiled with the system C++ compiler as plain C++17 without torch's
headers, and run; a failure shows the program's own report.

Built twice: warnings as errors at -O1, and under AddressSanitizer and UndefinedBehaviorSanitizer (an
out-of-range index or an overflow in the arithmetic fails there even when the checks pass). A third build
compiles every engine source of csrc/aio, with no torch include path, so that torch never creeps into the
engine (only the binding's files may see it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from op_builder import tunables
from op_builder.engines import ENGINES

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
AIO = REPO / "csrc" / "aio"
# The units under test and what they link.
UNITS = ["plan.cpp", "file.cpp", "error.cpp", "tunables.cpp", "staging_share.cpp", "pipeline.cpp"]
# csrc/aio files that belong to the Python binding and may include torch or Python headers.
BINDING_SIDE = {"py_aio.cpp", "aligned_tensor.cpp", "pinned.cpp", "storage_loan.cpp"}
WARNINGS = ["-Wall", "-Wextra", "-Werror"]


def _cxx() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler on PATH (set CXX)")
    return cxx


def _compile(args: list[str], what: str) -> None:
    proc = subprocess.run([_cxx(), "-std=c++17", *WARNINGS, *tunables.defines(), f"-I{AIO}", *args],
                          capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        pytest.fail(f"{what} does not compile:\n{proc.stderr[-6000:]}")


def _build_and_run(out: Path, flags: list[str], env: dict[str, str] | None = None) -> str:
    sources = [str(p) for p in sorted(HERE.glob("*.cpp"))] + [str(AIO / u) for u in UNITS]
    _compile([f"-I{HERE}", *flags, *sources, "-o", str(out)], "the C++ unit tests")
    proc = subprocess.run([str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    report = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"C++ unit tests failed (exit status {proc.returncode}):\n{report[-8000:]}")
    return report


def test_cpp_units(tmp_path):
    report = _build_and_run(tmp_path / "units", ["-O1"])
    assert " 0 failed, 0 failed checks" in report
    # Every test file contributed: a source left out of the build would pass by running nothing.
    for src in HERE.glob("test_*.cpp"):
        assert "TEST(" in src.read_text(), src


def test_cpp_units_under_address_and_undefined_sanitizers(tmp_path):
    report = _build_and_run(tmp_path / "units-asan",
                            ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                             "-fno-omit-frame-pointer"],
                            env={"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"})
    assert " 0 failed, 0 failed checks" in report


def test_engine_sources_compile_without_torch():
    engine = sorted(p for p in AIO.glob("*.cpp") if p.name not in BINDING_SIDE)
    assert {"handle.cpp", "worker.cpp", "plan.cpp", "transfer.cpp"} <= {p.name for p in engine}
    # Each engine's real code, not its stub: the library switches on as if found (headers only, no link).
    defines = [f"-D{e.define}=1" for e in ENGINES if e.needs_library]
    _compile(["-fsyntax-only", *defines, *map(str, engine)], "the engine, without torch's headers,")
    # The list above stays true: each binding-side file is one (else it belongs with the engine).
    for name in BINDING_SIDE:
        text = (AIO / name).read_text()
        assert any(h in text for h in ("<torch/", "<ATen/", "<Python.h>")), name
