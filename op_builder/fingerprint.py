"""Cheap (stat-only) identities of what probes and -march=native builds depend on, for the JIT stamp."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sysconfig
from collections.abc import Sequence

from .capability import env_key
from .toolchain import compiler_argv, cxx_argv, split_env

__all__ = ["cpu_fingerprint", "state_fingerprint"]


def cpu_fingerprint() -> str:
    """A cheap identity of this CPU model and feature set (no subprocess): a `-march=native` build made
    on one CPU must not be reused on another sharing the same cache directory."""
    h = hashlib.sha256(platform.machine().encode())
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key = line.split(":", 1)[0].strip()
                if key in ("vendor_id", "cpu family", "model", "model name", "flags", "Features",
                           "CPU implementer", "CPU part", "cpu", "isa"):
                    h.update(line.encode())
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:16]


def _search_dirs() -> tuple[list[str], list[str]]:
    """Header and library directories a probe would search, from the environment and the usual places,
    found without running the compiler."""
    inc = [a[2:] for a in split_env("CFLAGS") + split_env("CPPFLAGS") if a.startswith("-I")]
    lib = [a[2:] for a in split_env("LDFLAGS") if a.startswith("-L")]
    prefix = os.environ.get("CONDA_PREFIX", "").strip()
    if prefix:
        inc.append(f"{prefix}/include")
        lib.append(f"{prefix}/lib")
    for var in ("CPATH", "C_INCLUDE_PATH"):
        inc += [p for p in os.environ.get(var, "").split(os.pathsep) if p]
    lib += [p for p in os.environ.get("LIBRARY_PATH", "").split(os.pathsep) if p]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    inc += ["/usr/local/include", *([f"/usr/include/{multiarch}"] if multiarch else []), "/usr/include"]
    lib += ["/usr/local/lib", *([f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []),
            "/usr/lib64", "/lib64", "/usr/lib", "/lib"]
    return inc, lib


def _stat_token(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:-"
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def state_fingerprint(headers: Sequence[str] = (), libraries: Sequence[str] = (),
                      extra_paths: Sequence[str] = ()) -> str:
    """A cheap (stat-only) digest of everything a probe of ``headers``/``libraries`` depends on: the probe
    environment variables, the compiler binaries and every place the header or library could be found.

    Used to decide whether cached probe outcomes still hold without running the compiler again.
    """
    h = hashlib.sha256(repr(env_key()).encode())
    for argv in (compiler_argv(), cxx_argv()):
        exe = shutil.which(argv[0]) if argv else None
        h.update(_stat_token(os.path.realpath(exe)).encode() if exe else b"no-compiler")
    inc, lib = _search_dirs()
    for header in headers:
        for d in inc:
            h.update(_stat_token(os.path.join(d, header)).encode())
    for name in libraries:
        for d in lib:
            for suffix in (".so", ".a"):
                h.update(_stat_token(os.path.join(d, f"lib{name}{suffix}")).encode())
    for p in extra_paths:
        h.update(_stat_token(p).encode())
    return h.hexdigest()
