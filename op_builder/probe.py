"""Capability probes: real compile-and-link (and one compile-and-run) checks against the C compiler.

Every probe calls the compiler directly through ``subprocess`` (distutils is gone from Python 3.12), honours
``CC``, ``CFLAGS``, ``LDFLAGS`` and ``CONDA_PREFIX``, and is cached per process. Nothing here runs at import
time and nothing imports torch except :func:`cuda`, and only when it is called.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Capability",
    "CufileLocation",
    "clear_cache",
    "compiler",
    "compiler_argv",
    "cpu_fingerprint",
    "cuda",
    "cuda_home",
    "cufile",
    "find_cufile",
    "has_function",
    "io_uring_runtime",
    "libaio",
    "liburing",
    "native_arch_flags",
    "ninja",
    "state_fingerprint",
]

# Environment variables that change what a probe (or a build) would find.
PROBE_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CONDA_PREFIX", "CPATH",
             "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH")

_COMPILE_TIMEOUT_S = 120
_RUN_TIMEOUT_S = 20
_TAIL_LINES = 20

LIBAIO_FUNCTIONS = ("io_setup", "io_submit", "io_getevents", "io_destroy", "io_cancel")
LIBURING_FUNCTIONS = ("io_uring_queue_init", "io_uring_get_sqe", "io_uring_submit", "io_uring_wait_cqe_nr",
                      "io_uring_peek_batch_cqe", "io_uring_queue_exit", "io_uring_register_buffers")
CUFILE_FUNCTIONS = ("cuFileDriverOpen", "cuFileRead", "cuFileWrite", "cuFileHandleRegister",
                    "cuFileBufRegister")


@dataclass(frozen=True)
class Capability:
    """One thing the machine has or lacks, with what was found, why it is missing and how to fix that."""

    name: str
    ok: bool
    detail: str = ""
    reason: str = ""
    fix: str = ""

    def __bool__(self) -> bool:  # lets callers write `if probe.libaio():`
        return self.ok


def clear_cache() -> None:
    """Forget every cached probe result (tests change CC/CFLAGS between probes)."""
    for fn in (_has_function, _compiler, _ninja, _libaio, _liburing, _io_uring_runtime, _cuda, _cufile,
               _native_arch_flags):
        fn.cache_clear()


def _env_key() -> tuple[str | None, ...]:
    # Part of every cache key: a probe must not answer for an environment it did not see.
    return tuple(os.environ.get(k) for k in PROBE_ENV)


# ----------------------------------------------------------------------------------------------- compiler
def compiler_argv() -> list[str]:
    """The C compiler command: ``$CC`` (may carry arguments), else ``cc``, else ``gcc``; [] if none."""
    env = os.environ.get("CC", "").strip()
    if env:
        return shlex.split(env)
    for cand in ("cc", "gcc"):
        if shutil.which(cand):
            return [cand]
    return []


def _cxx_argv() -> list[str]:
    # torch's cpp_extension compiles with $CXX, else c++.
    env = os.environ.get("CXX", "").strip()
    return shlex.split(env) if env else ["c++"]


def _split_env(name: str) -> list[str]:
    return [a for a in shlex.split(os.environ.get(name, "")) if a]


def _conda_dirs() -> tuple[list[str], list[str]]:
    prefix = os.environ.get("CONDA_PREFIX", "").strip()
    if not prefix:
        return [], []
    return [f"-I{prefix}/include"], [f"-L{prefix}/lib", f"-Wl,-rpath,{prefix}/lib"]


def _tail(text: str, n: int = _TAIL_LINES) -> str:
    # Drop the bare input-file lines that `-Wl,-t` prints: they hide the diagnostics.
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not re.fullmatch(r"\s*/\S+", ln)]
    return "\n".join(lines[-n:])


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    # LC_ALL=C: plain ASCII quotes and English messages, so failures can be parsed and quoted.
    env = {**os.environ, "LC_ALL": "C"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def _version_line(argv: list[str]) -> str:
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


@functools.cache
def _compiler(_env: tuple) -> Capability:
    cc = compiler_argv()
    if not cc:
        return Capability("compiler", False, "", "no C compiler found (tried $CC, cc, gcc)",
                          "apt-get install build-essential (or set CC to your compiler)")
    cxx = _cxx_argv()
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
    return _compiler(_env_key())


@functools.cache
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


# ----------------------------------------------------------------------------------------- has_function
def _probe_source(functions: Sequence[str], headers: Sequence[str]) -> str:
    lines = [f"#include <{h}>" for h in headers]
    if not headers:
        # No header to declare them: declare each as autoconf does, enough to make the linker look.
        lines += [f"char {fn}(void);" for fn in functions]
    lines.append("typedef void (*deepnvme_probe_fn)(void);")
    # Taking each address (rather than calling) needs no arguments and still forces the link to resolve it;
    # volatile stops the optimiser from dropping the references.
    refs = ", ".join(f"(deepnvme_probe_fn)&{fn}" for fn in functions)
    lines.append(f"static volatile deepnvme_probe_fn deepnvme_probe_refs[] = {{{refs}}};")
    lines.append("int main(void) { return deepnvme_probe_refs[0] == (deepnvme_probe_fn)0; }")
    return "\n".join(lines) + "\n"


def _explain_failure(output: str, functions: Sequence[str], libraries: Sequence[str],
                     headers: Sequence[str]) -> str:
    """Turn compiler/linker noise into one sentence naming the missing piece."""
    m = re.search(r"fatal error: ([^:\s]+): No such file", output)
    if m:
        return f"header {m.group(1)} not found"
    m = re.search(r"cannot find -l:?(\S+?)(?::|\s|$)", output)
    if m:
        return f"library lib{m.group(1)} not found by the linker" if not m.group(1).startswith("lib") \
            else f"library {m.group(1)} not found by the linker"
    undefined = set(re.findall(r"undefined reference to [`'\u2018]([^'`\u2019]+)['\u2019]", output))
    missing = sorted(undefined & set(functions))
    if missing:
        where = f" in {', '.join('-l' + lib for lib in libraries)}" if libraries else ""
        return f"function(s) {', '.join(missing)} not found{where}"
    undeclared = sorted({fn for fn in functions
                         if re.search(rf"['\u2018]{re.escape(fn)}['\u2019] (?:undeclared|was not declared)",
                                      output)})
    if undeclared:
        return f"function(s) {', '.join(undeclared)} not declared by {', '.join(headers) or 'any header'}"
    return "compile/link check failed"


def _linked_library_paths(trace: str, libraries: Sequence[str]) -> list[str]:
    # `-Wl,-t` makes GNU ld / lld print every input file; keep the ones that are our libraries.
    found = []
    for lib in libraries:
        stem = lib[1:] if lib.startswith(":") else f"lib{lib}."
        for line in trace.splitlines():
            line = line.strip().strip("()")
            path = line.split("(")[-1].rstrip(")") if "(" in line else line
            if os.path.basename(path).startswith(stem) and os.path.exists(path):
                found.append(os.path.realpath(path))
                break
    return found


@functools.cache
def _has_function(functions: tuple[str, ...], libraries: tuple[str, ...], headers: tuple[str, ...],
                  include_dirs: tuple[str, ...], library_dirs: tuple[str, ...],
                  extra_ldflags: tuple[str, ...],
                  verbose: bool, name: str, _env: tuple) -> Capability:
    label = name or ", ".join(functions)
    cc = compiler_argv()
    if not cc:
        return Capability(label, False, "", "no C compiler found (tried $CC, cc, gcc)",
                          "apt-get install build-essential (or set CC)")
    conda_inc, conda_lib = _conda_dirs()
    with tempfile.TemporaryDirectory(prefix="deepnvme_probe_") as tmp:
        src = Path(tmp, "probe.c")
        src.write_text(_probe_source(functions, headers))
        argv = [*cc, *_split_env("CFLAGS"), *conda_inc, *(f"-I{d}" for d in include_dirs),
                str(src), "-o", str(Path(tmp, "probe")),
                *_split_env("LDFLAGS"), *conda_lib, *(f"-L{d}" for d in library_dirs),
                *(f"-l{lib}" for lib in libraries), *extra_ldflags, "-Wl,-t"]
        if verbose:
            print("deepnvme probe:", shlex.join(argv), file=sys.stderr)
        try:
            res = _run(argv, _COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return Capability(label, False, "", f"could not run the compiler {cc[0]!r}: {exc}",
                              "install a C compiler or set CC")
        out = (res.stdout or "") + (res.stderr or "")
        if verbose:
            print(out, file=sys.stderr)
        if res.returncode != 0:
            why = _explain_failure(out, functions, libraries, headers)
            return Capability(label, False, "", f"{why}; compiler said:\n{_tail(out)}",
                              "install the development package that provides it "
                              "(or set CFLAGS/LDFLAGS to its location)")
        libs = _linked_library_paths(out, libraries)
        return Capability(label, True, ", ".join(libs))


def has_function(functions: Sequence[str], libraries: Sequence[str] = (), headers: Sequence[str] = (),
                 include_dirs: Sequence[str] = (), library_dirs: Sequence[str] = (), verbose: bool = False,
                 *, extra_ldflags: Sequence[str] = (), name: str = "") -> Capability:
    """Compile and link a program that includes ``headers`` and takes the address of every function.

    ``ok`` is True only if every function is declared (when headers are given) and resolves at link time
    against ``libraries``. A failure's ``reason`` names the missing header/library/function and ends with
    the compiler's last lines.
    """
    if isinstance(functions, str):
        functions = [functions]
    return _has_function(tuple(functions), tuple(libraries), tuple(headers), tuple(map(str, include_dirs)),
                         tuple(map(str, library_dirs)), tuple(extra_ldflags), bool(verbose), name, _env_key())


def _version_from_soname(path: str) -> str:
    # libaio.so.1.0.2 -> 1.0.2 (the file name is the cheapest version signal available without dpkg)
    m = re.search(r"\.so\.([0-9.]+)$", path)
    return m.group(1) if m else ""


def _dpkg_version(package: str) -> str:
    if not shutil.which("dpkg-query"):
        return ""
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _lib_detail(cap: Capability, packages: Sequence[str]) -> str:
    parts = []
    for path in filter(None, cap.detail.split(", ")):
        ver = _version_from_soname(path)
        parts.append(f"{path}" + (f" (so version {ver})" if ver else ""))
    for pkg in packages:
        ver = _dpkg_version(pkg)
        if ver:
            parts.append(f"{pkg} {ver}")
            break
    return "; ".join(parts)


def _system_library(name: str, functions: Sequence[str], lib: str, packages: Sequence[str]) -> Capability:
    """A C library (``lib<lib>``, header ``<name>.h``) with every function listed; the fix names the Debian
    package (``packages[0]``) and its Fedora twin."""
    cap = has_function(functions, (lib,), (f"{name}.h",), name=name)
    if not cap.ok:
        return Capability(name, False, "", cap.reason,
                          f"apt-get install {packages[0]} (dnf install {name}-devel; or set CFLAGS/LDFLAGS "
                          "to its location)")
    return Capability(name, True, _lib_detail(cap, packages))


@functools.cache
def _libaio(_env: tuple) -> Capability:
    return _system_library("libaio", LIBAIO_FUNCTIONS, "aio", ("libaio-dev", "libaio1t64", "libaio1"))


def libaio() -> Capability:
    """libaio header and library with every function the libaio engine uses."""
    return _libaio(_env_key())


@functools.cache
def _liburing(_env: tuple) -> Capability:
    return _system_library("liburing", LIBURING_FUNCTIONS, "uring", ("liburing-dev", "liburing2"))


def liburing() -> Capability:
    """liburing header and library with every function the io_uring engine uses."""
    return _liburing(_env_key())


_URING_RUNTIME_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    struct io_uring ring;
    struct io_uring_sqe *sqe;
    struct io_uring_cqe *cqe;
    char buf[64];
    int fd, r;
    if (argc < 3) return 64;
    r = io_uring_queue_init(4, &ring, 0);
    if (r < 0) { fprintf(stderr, "io_uring_queue_init: %s (errno %d)\n", strerror(-r), -r); return 2; }
    fd = open(argv[1], O_RDONLY);
    if (fd < 0) { fprintf(stderr, "open: %s\n", strerror(errno)); return 3; }
    sqe = io_uring_get_sqe(&ring);
    if (!sqe) { fprintf(stderr, "io_uring_get_sqe: no free entry\n"); return 4; }
    io_uring_prep_read(sqe, fd, buf, sizeof(buf), 0);
    r = io_uring_submit(&ring);
    if (r != 1) { fprintf(stderr, "io_uring_submit: %s (errno %d)\n", r < 0 ? strerror(-r) : "short", -r);
                  return 5; }
    r = io_uring_wait_cqe(&ring, &cqe);
    if (r < 0) { fprintf(stderr, "io_uring_wait_cqe: %s (errno %d)\n", strerror(-r), -r); return 6; }
    if (cqe->res < 0) { fprintf(stderr, "read completion: %s (errno %d)\n", strerror(-cqe->res), -cqe->res);
                        return 7; }
    if ((size_t)cqe->res != strlen(argv[2]) || memcmp(buf, argv[2], (size_t)cqe->res) != 0) {
        fprintf(stderr, "read completion returned %d bytes with the wrong content\n", cqe->res); return 8; }
    io_uring_cqe_seen(&ring, cqe);
    io_uring_queue_exit(&ring);
    close(fd);
    printf("ok\n");
    return 0;
}
"""


@functools.cache
def _io_uring_runtime(_env: tuple) -> Capability:
    lib = liburing()
    if not lib.ok:
        first = lib.reason.splitlines()[0] if lib.reason else "not found"
        return Capability("io_uring runtime", False, "", f"liburing is not usable: {first}", lib.fix)
    cc = compiler_argv()
    conda_inc, conda_lib = _conda_dirs()
    payload = "deepnvme io_uring probe"
    with tempfile.TemporaryDirectory(prefix="deepnvme_uring_") as tmp:
        src, exe, data = Path(tmp, "uring.c"), Path(tmp, "uring"), Path(tmp, "data")
        src.write_text(_URING_RUNTIME_C)
        data.write_text(payload)
        argv = [*cc, *_split_env("CFLAGS"), *conda_inc, str(src), "-o", str(exe), *_split_env("LDFLAGS"),
                *conda_lib, "-luring"]
        try:
            res = _run(argv, _COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return Capability("io_uring runtime", False, "", f"could not run the compiler: {exc}", "set CC")
        if res.returncode != 0:
            return Capability("io_uring runtime", False, "",
                              f"the io_uring test program did not build:\n{_tail(res.stderr)}", lib.fix)
        try:
            run = _run([str(exe), str(data), payload], _RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Capability("io_uring runtime", False, "", "a single io_uring read did not complete in "
                              f"{_RUN_TIMEOUT_S} s", "use the libaio or posix engine")
        if run.returncode != 0:
            msg = _tail(run.stderr or run.stdout, 3) or f"exit status {run.returncode}"
            return Capability("io_uring runtime", False, "", f"io_uring round trip failed: {msg}",
                              "io_uring is forbidden here (container seccomp profile, or sysctl "
                              "kernel.io_uring_disabled); allow it, or use the libaio/posix engine")
    return Capability("io_uring runtime", True,
                      f"ring init, read and reap worked (kernel {platform.release()})")


def io_uring_runtime() -> Capability:
    """Build and run a tiny program: ring init, one real read of a temp file, reap. Fails with the errno."""
    return _io_uring_runtime(_env_key())


# ------------------------------------------------------------------------------------------------ CUDA
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


def _nvcc_version(home: str) -> str:
    nvcc = os.path.join(home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"release (\d+\.\d+)", out.stdout)
    return m.group(1) if m else ""


@functools.cache
def _cuda(_env: tuple) -> Capability:
    try:
        import torch  # deferred: only this probe needs torch
    except ImportError as exc:
        return Capability("cuda", False, "", f"torch is not importable ({exc})",
                          "install torch (a CUDA build) first")
    home = cuda_home()
    nvcc = _nvcc_version(home) if home else ""
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
    return _cuda(_env_key())


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


@functools.cache
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
    return _cufile(_env_key())


# ------------------------------------------------------------------------------------ CPU and fingerprints
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


@functools.cache
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


def _search_dirs() -> tuple[list[str], list[str]]:
    """Header and library directories a probe would search, from the environment and the usual places,
    found without running the compiler."""
    inc = [a[2:] for a in _split_env("CFLAGS") + _split_env("CPPFLAGS") if a.startswith("-I")]
    lib = [a[2:] for a in _split_env("LDFLAGS") if a.startswith("-L")]
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
    h = hashlib.sha256(repr(_env_key()).encode())
    for argv in (compiler_argv(), _cxx_argv()):
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
