"""CUDA discovery without a CUDA build of torch: the toolkit (CUDA_HOME, nvcc) and cuFile for the gds op."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass

from .capability import Capability, cached_probe, env_key
from .linktest import has_function

__all__ = ["CUFILE_FUNCTIONS", "CufileLocation", "cuda", "cuda_home", "cufile", "find_cufile", "nvcc_version"]

CUFILE_FUNCTIONS = ("cuFileDriverOpen", "cuFileRead", "cuFileWrite", "cuFileHandleRegister",
                    "cuFileBufRegister")


def cuda_home() -> str | None:
    """CUDA toolkit root the way torch finds it (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda),
    but without requiring a CUDA build of torch."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home if os.path.isdir(home) else None
    nvcc = shutil.which("nvcc")
    if nvcc:
        # A wrapper script in /usr/local/bin would point at /usr/local; resolve through symlinks first and
        # accept the guess only if it holds include/cuda_runtime.h.
        for cand in (os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                     os.path.dirname(os.path.dirname(nvcc))):
            if os.path.exists(os.path.join(cand, "include", "cuda_runtime.h")):
                return cand
    if os.path.isdir("/usr/local/cuda"):
        return "/usr/local/cuda"
    return None


def nvcc_version(home: str) -> str:
    """major.minor of ``<home>/bin/nvcc --version``; "" when it does not run."""
    nvcc = os.path.join(home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"release (\d+\.\d+)", out.stdout)
    return m.group(1) if m else ""


@cached_probe
def _cuda(_env: tuple) -> Capability:
    try:
        import torch  # deferred: only this probe needs torch
    except ImportError as exc:
        return Capability("cuda", False, "", f"torch is not importable ({exc})",
                          "install torch (a CUDA build) first")
    home = cuda_home()
    nvcc = nvcc_version(home) if home else ""
    found = ", ".join(filter(None, [f"torch {torch.__version__}", f"CUDA_HOME={home}" if home else "",
                                    f"nvcc {nvcc}" if nvcc else ""]))
    if torch.version.cuda is None:
        return Capability("cuda", False, found, f"torch {torch.__version__} is a CPU-only build "
                          "(torch.version.cuda is None)",
                          "install a CUDA build of torch (pip install torch --index-url "
                          "https://download.pytorch.org/whl/cu1XX)")
    if not home:
        return Capability("cuda", False, found, "no CUDA toolkit found (CUDA_HOME, nvcc, /usr/local/cuda)",
                          "install the CUDA toolkit and set CUDA_HOME")
    if not nvcc:
        return Capability("cuda", False, found, f"{home}/bin/nvcc is missing or does not run",
                          "install the CUDA toolkit's nvcc, or point CUDA_HOME at a full toolkit")
    if nvcc.split(".")[0] != torch.version.cuda.split(".")[0]:
        return Capability("cuda", False, found + f", torch built with CUDA {torch.version.cuda}",
                          f"nvcc {nvcc} and torch's CUDA {torch.version.cuda} differ in major version",
                          "install a toolkit matching torch's CUDA major version, or a matching torch")
    return Capability("cuda", True, found + f", torch built with CUDA {torch.version.cuda}")


def cuda() -> Capability:
    """Is torch a CUDA build, and is a matching CUDA toolkit (CUDA_HOME, nvcc) present?"""
    return _cuda(env_key())


@dataclass(frozen=True)
class CufileLocation:
    """Where cufile.h and libcufile were found; link_arg is ``-lcufile`` or ``-l:libcufile.so.N``."""

    include_dir: str | None
    library_dir: str | None
    link_arg: str


def _site_dirs() -> list[str]:
    dirs = [p for p in sys.path if p and os.path.isdir(p)]
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and p not in dirs:
            dirs.append(p)
    return dirs


def _cufile_candidates() -> tuple[list[str], list[str]]:
    incs, libs = [], []
    home = cuda_home()
    if home:
        incs += [f"{home}/include", *sorted(glob.glob(f"{home}/targets/*/include"))]
        libs += [f"{home}/lib64", f"{home}/lib", *sorted(glob.glob(f"{home}/targets/*/lib"))]
    for site in _site_dirs():
        # The nvidia-cufile wheel: site-packages/nvidia/cufile/{include,lib}; newer releases use
        # site-packages/nvidia/cu<major>/{include,lib}.
        bases = [os.path.join(site, "nvidia", "cufile"),
                 *sorted(glob.glob(os.path.join(site, "nvidia", "cu[0-9]*")), reverse=True)]
        for base in bases:
            if os.path.isdir(base):
                incs.append(os.path.join(base, "include"))
                libs.append(os.path.join(base, "lib"))
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    incs += ["/usr/include", "/usr/local/include"]
    libs += [f"/usr/lib/{multiarch}" if multiarch else "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    return incs, libs


def find_cufile() -> CufileLocation:
    """Locate cufile.h and libcufile under CUDA_HOME, the nvidia-cufile wheel, or the system."""
    incs, libs = _cufile_candidates()
    inc = next((d for d in incs if os.path.exists(os.path.join(d, "cufile.h"))), None)
    for d in libs:
        if os.path.exists(os.path.join(d, "libcufile.so")):
            return CufileLocation(inc, d, "-lcufile")
        versioned = sorted(glob.glob(os.path.join(d, "libcufile.so.[0-9]*")))
        if versioned:  # the wheel ships only libcufile.so.0: link it by file name
            return CufileLocation(inc, d, f"-l:{os.path.basename(versioned[0])}")
    return CufileLocation(inc, None, "-lcufile")


@cached_probe
def _cufile(_env: tuple) -> Capability:
    loc = find_cufile()
    fix = ("pip install nvidia-cufile (or install the CUDA toolkit's GDS/cuFile package; "
           "or set CFLAGS/LDFLAGS)")
    if loc.include_dir is None:
        incs, _ = _cufile_candidates()
        return Capability("cufile", False, "", f"cufile.h not found (looked in {', '.join(incs)})", fix)
    home = cuda_home()
    include_dirs = [loc.include_dir] + ([f"{home}/include"] if home else [])
    cap = has_function(CUFILE_FUNCTIONS, (), ("cufile.h",), include_dirs=include_dirs,
                       library_dirs=[loc.library_dir] if loc.library_dir else [],
                       # libcufile needs libcuda (the driver) at run time only; a build box may have none.
                       extra_ldflags=(loc.link_arg, "-Wl,--allow-shlib-undefined"), name="cufile")
    if not cap.ok:
        return Capability("cufile", False, f"cufile.h in {loc.include_dir}", cap.reason, fix)
    return Capability("cufile", True, f"cufile.h in {loc.include_dir}; library in {loc.library_dir} "
                                      f"({loc.link_arg})")


def cufile() -> Capability:
    """cufile.h and libcufile with the functions the GDS op uses."""
    return _cufile(env_key())
