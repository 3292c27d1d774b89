"""The compilers and ninja: which ones run, how to call them, and which flags tune a build for this CPU."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess

from .capability import Capability, cached_probe, env_key

__all__ = ["compiler", "compiler_argv", "compiler_identity", "conda_dirs", "cxx_argv", "native_arch_flags",
           "ninja", "run", "split_env"]


def compiler_argv() -> list[str]:
    """The C compiler command: ``$CC`` (may carry arguments), else ``cc``, else ``gcc``; [] if none."""
    env = os.environ.get("CC", "").strip()
    if env:
        return shlex.split(env)
    for cand in ("cc", "gcc"):
        if shutil.which(cand):
            return [cand]
    return []


def cxx_argv() -> list[str]:
    """The C++ compiler torch's cpp_extension builds with: ``$CXX``, else ``c++``."""
    env = os.environ.get("CXX", "").strip()
    return shlex.split(env) if env else ["c++"]


def compiler_identity() -> str:
    """The C++ compiler command and the size and time of its real binary (part of a JIT build's key)."""
    argv = cxx_argv()
    exe = shutil.which(argv[0]) if argv else None
    if not exe:
        return " ".join(argv)
    real = os.path.realpath(exe)
    st = os.stat(real)
    return f"{' '.join(argv)} -> {real}:{st.st_size}:{st.st_mtime_ns}"


def split_env(name: str) -> list[str]:
    """A flags variable (CFLAGS, LDFLAGS...) as arguments."""
    return [a for a in shlex.split(os.environ.get(name, "")) if a]


def conda_dirs() -> tuple[list[str], list[str]]:
    """Compile and link flags for ``$CONDA_PREFIX``'s include and lib folders (none outside conda)."""
    prefix = os.environ.get("CONDA_PREFIX", "").strip()
    if not prefix:
        return [], []
    return [f"-I{prefix}/include"], [f"-L{prefix}/lib", f"-Wl,-rpath,{prefix}/lib"]


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a compiler or probe program; LC_ALL=C keeps its messages English and ASCII, so they parse."""
    env = {**os.environ, "LC_ALL": "C"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def _version_line(argv: list[str]) -> str:
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


@cached_probe
def _compiler(_env: tuple) -> Capability:
    cc = compiler_argv()
    if not cc:
        return Capability("compiler", False, "", "no C compiler found (tried $CC, cc, gcc)",
                          "apt-get install build-essential (or set CC to your compiler)")
    cxx = cxx_argv()
    cc_ver = _version_line(cc)
    if not cc_ver:
        return Capability("compiler", False, "", f"C compiler {' '.join(cc)!r} does not run",
                          "apt-get install build-essential (or set CC to a working compiler)")
    cxx_ver = _version_line(cxx)
    if not cxx_ver:
        return Capability("compiler", False, f"cc: {cc_ver}",
                          f"C++ compiler {' '.join(cxx)!r} (used by torch's builds) does not run",
                          "apt-get install g++ (or set CXX to a working C++ compiler)")
    return Capability("compiler", True, f"cc: {shutil.which(cc[0]) or cc[0]} ({cc_ver}); "
                                        f"c++: {shutil.which(cxx[0]) or cxx[0]} ({cxx_ver})")


def compiler() -> Capability:
    """Is there a working C compiler (for probes) and C++ compiler (for builds)?"""
    return _compiler(env_key())


@cached_probe
def _ninja(_path: str | None) -> Capability:
    exe = shutil.which("ninja")
    if not exe:
        return Capability("ninja", False, "", "ninja is not on PATH (JIT builds need it)",
                          "pip install ninja")
    ver = _version_line([exe])
    if not ver:
        return Capability("ninja", False, exe, f"{exe} --version failed",
                          "pip install --force-reinstall ninja")
    return Capability("ninja", True, f"{exe} {ver}")


def ninja() -> Capability:
    """Is ninja (torch's JIT build driver) on PATH and runnable?"""
    return _ninja(os.environ.get("PATH"))


@cached_probe
def _native_arch_flags() -> tuple[str, ...]:
    arch = ""
    try:
        import cpuinfo  # py-cpuinfo; slow (it spawns a helper process), so only cold builds reach here

        arch = str(cpuinfo.get_cpu_info().get("arch", ""))
    except Exception:  # noqa: BLE001 - py-cpuinfo failing must never break a build
        arch = ""
    if not arch:
        machine = platform.machine().lower()
        arch = {"x86_64": "X86_64", "amd64": "X86_64", "aarch64": "ARM_8", "arm64": "ARM_8",
                "ppc64le": "PPC_64", "riscv64": "RISCV_64"}.get(machine, machine.upper())
    if arch.startswith("PPC"):
        return ("-mcpu=native",)
    if arch.startswith("RISCV"):
        return ("-march=rv64gc",)
    if arch.startswith(("X86", "ARM")):
        return ("-march=native",)
    return ()


def native_arch_flags() -> list[str]:
    """Flags that tune a JIT build for this CPU (from py-cpuinfo; lscpu-free fallback on platform)."""
    return list(_native_arch_flags())
