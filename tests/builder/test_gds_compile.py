"""The gds op cannot rot unseen on a machine without a GPU: every source it compiles passes the compiler with
the builder's own flags against torch's headers, CUDA's headers and cufile.h, the cuFile/CUDA functions its
objects call exist in the libraries it links, and ds_report says why gds cannot be built on CPU-only torch."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch")

from op_builder import probe  # noqa: E402
from op_builder.gds import GDSBuilder  # noqa: E402

# Sources this project owns for gds are held to -Werror; async_io's are checked by the same compiler run
# without it, so that a new warning there fails async_io's own checks first, not this one.
WERROR_DIR = REPO / "csrc" / "gds"


def _site_dirs() -> list[str]:
    dirs = [p for p in sys.path if p and os.path.isdir(p)]
    dirs += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    return list(dict.fromkeys(dirs))


def _cufile_dirs() -> tuple[str | None, str | None]:
    """cufile.h's folder and libcufile's folder: the builder's probe first, else the nvidia-cufile wheel,
    which installs under nvidia/cufile (CUDA 12 wheels) or nvidia/cu13 (CUDA 13 wheels)."""
    loc = probe.find_cufile()
    inc, lib = loc.include_dir, loc.library_dir
    for site in _site_dirs():
        for base in sorted(glob.glob(os.path.join(site, "nvidia", "*"))):
            if inc is None and os.path.exists(os.path.join(base, "include", "cufile.h")):
                inc = os.path.join(base, "include")
            if lib is None and glob.glob(os.path.join(base, "lib", "libcufile.so*")):
                lib = os.path.join(base, "lib")
    return inc, lib


def _cuda_include() -> str | None:
    home = probe.cuda_home() or "/usr/local/cuda"
    inc = os.path.join(home, "include")
    ok = all(os.path.exists(os.path.join(inc, h)) for h in ("cuda.h", "cuda_runtime_api.h"))
    return inc if ok else None


@pytest.fixture(scope="module")
def check_argv() -> tuple[list[str], list[str]]:
    """(compiler flags, sources) of the builder's syntax check, with cufile.h wherever it was found."""
    inc, _ = _cufile_dirs()
    if inc is None:
        pytest.skip("cufile.h not found (pip install nvidia-cufile)")
    if _cuda_include() is None:
        pytest.skip("CUDA headers not found (set CUDA_HOME; no include/cuda_runtime_api.h under it)")
    builder = GDSBuilder()
    argv = builder.syntax_check_command(extra_include_dirs=[inc])
    if shutil.which(argv[0]) is None:
        pytest.skip(f"no C++ compiler ({argv[0]})")
    sources = [str(builder.src_path(s)) for s in builder.sources()]
    flags = [a for a in argv if a not in sources]
    if f"-isystem{_cuda_include()}" not in flags:
        flags.append(f"-isystem{_cuda_include()}")
    return flags, sources


def _compile(argv: list[str]) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    return argv, subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_gds_sources_are_in_the_build(check_argv: tuple[list[str], list[str]]) -> None:
    _, sources = check_argv
    names = {Path(s).relative_to(REPO).as_posix() for s in sources}
    gds = {p.relative_to(REPO).as_posix() for p in WERROR_DIR.glob("*.cpp")}
    assert gds and gds <= names
    assert "csrc/aio/handle.cpp" in names and "csrc/aio/py_aio.cpp" not in names  # one binding per module


def test_every_gds_source_compiles(check_argv: tuple[list[str], list[str]]) -> None:
    """One compiler per source, in parallel: the torch-heavy binding dominates (~20 s on 2 cores)."""
    flags, sources = check_argv
    jobs = []
    for src in sorted(sources, key=lambda s: Path(s).name != "py_gds.cpp"):  # slowest first
        extra = ["-Werror"] if Path(src).parent == WERROR_DIR else []
        jobs.append([*flags, *extra, src])
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(_compile, jobs))
    failures = [f"{argv[-1]}:\n{r.stderr[-3000:]}" for argv, r in results if r.returncode != 0]
    assert not failures, "\n\n".join(failures)


def test_cufile_and_cuda_functions_exist_in_the_libraries(check_argv: tuple[list[str], list[str]],
                                                          tmp_path: Path) -> None:
    """Every cuFile*/cuda* function the engine objects call is exported by the libcufile and libcudart that
    the builder links: an API newer than the library would otherwise surface only at import on a GPU box."""
    _, libdir = _cufile_dirs()
    home = probe.cuda_home() or "/usr/local/cuda"
    cudart = sorted(glob.glob(os.path.join(home, "lib*", "libcudart.so*")))
    cufile = sorted(glob.glob(os.path.join(libdir, "libcufile.so*"))) if libdir else []
    if not cufile or not cudart or shutil.which("nm") is None:
        pytest.skip("libcufile, libcudart or nm not found")
    flags, _ = check_argv
    flags = [a for a in flags if a != "-fsyntax-only"]
    # The binding calls no cuFile function itself, and is the slow one to build: leave it out.
    core = sorted(p for p in WERROR_DIR.glob("*.cpp") if p.name != "py_gds.cpp")
    jobs = [[*flags, "-c", str(src), "-o", str(tmp_path / (src.stem + ".o"))] for src in core]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        for argv, r in pool.map(_compile, jobs):
            assert r.returncode == 0, f"{argv[-3]}:\n{r.stderr[-3000:]}"
    undefined = subprocess.run(["nm", "-u", *map(str, tmp_path.glob("*.o"))], capture_output=True, text=True,
                               check=True).stdout.split()
    wanted = {s for s in undefined if s.startswith(("cuFile", "cuda"))}
    assert any(s.startswith("cuFileRead") for s in wanted)
    exported: set[str] = set()
    for lib in (cufile[0], cudart[0]):
        out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                             check=True).stdout
        exported |= {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    missing = sorted(wanted - exported)
    assert not missing, f"called but not exported by {cufile[0]} / {cudart[0]}: {missing}"


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch: gds may well be buildable")
def test_report_says_gds_no_on_cpu_torch() -> None:
    builder = GDSBuilder()
    assert not builder.is_compatible(verbose=False)
    out = subprocess.run([sys.executable, str(REPO / "bin" / "ds_report"), "--json"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    ops = {op["name"]: op for op in json.loads(out.stdout)["ops"]}
    gds = ops["gds"]
    assert gds["compatible"] is False
    assert "CPU-only" in gds["reason"] and "torch" in gds["reason"]
