"""Probes of the engines' system libraries: libaio and liburing link tests, and an io_uring round trip."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from . import diagnose, engines
from .capability import Capability, cached_probe, env_key
from .engines import Engine
from .linktest import COMPILE_TIMEOUT_S, has_function
from .toolchain import compiler_argv, conda_dirs, run, split_env

__all__ = ["LIBAIO_FUNCTIONS", "LIBURING_FUNCTIONS", "engine_library", "io_uring_runtime", "libaio",
           "liburing"]

_RUN_TIMEOUT_S = 20
# What each engine file calls, from the catalogue (kept under these names for older importers).
LIBAIO_FUNCTIONS = engines.by_name("libaio").functions
LIBURING_FUNCTIONS = engines.by_name("io_uring").functions


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


def engine_library(engine: Engine) -> Capability:
    """An engine's C library (its catalogue row's header, -l name and functions) with every function the
    engine file calls; the fix names the Debian package and its Fedora twin."""
    name = engine.probe
    cap = has_function(engine.functions, (engine.library,), (engine.header,), name=name)
    if not cap.ok:
        return Capability(name, False, "", cap.reason,
                          f"apt-get install {engine.packages[0]} (dnf install {engine.fedora_package}; "
                          "or set CFLAGS/LDFLAGS to its location)")
    return Capability(name, True, _lib_detail(cap, engine.packages))


@cached_probe
def _libaio(_env: tuple) -> Capability:
    return engine_library(engines.by_name("libaio"))


def libaio() -> Capability:
    """libaio header and library with every function the libaio engine uses."""
    return _libaio(env_key())


@cached_probe
def _liburing(_env: tuple) -> Capability:
    return engine_library(engines.by_name("io_uring"))


def liburing() -> Capability:
    """liburing header and library with every function the io_uring engine uses."""
    return _liburing(env_key())


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


@cached_probe
def _io_uring_runtime(_env: tuple) -> Capability:
    lib = liburing()
    if not lib.ok:
        first = lib.reason.splitlines()[0] if lib.reason else "not found"
        return Capability("io_uring runtime", False, "", f"liburing is not usable: {first}", lib.fix)
    cc = compiler_argv()
    conda_inc, conda_lib = conda_dirs()
    payload = "deepnvme io_uring probe"
    with tempfile.TemporaryDirectory(prefix="deepnvme_uring_") as tmp:
        src, exe, data = Path(tmp, "uring.c"), Path(tmp, "uring"), Path(tmp, "data")
        src.write_text(_URING_RUNTIME_C)
        data.write_text(payload)
        argv = [*cc, *split_env("CFLAGS"), *conda_inc, str(src), "-o", str(exe), *split_env("LDFLAGS"),
                *conda_lib, "-luring"]
        try:
            res = run(argv, COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return Capability("io_uring runtime", False, "", f"could not run the compiler: {exc}", "set CC")
        if res.returncode != 0:
            why = "the io_uring test program did not build:\n" + diagnose.tail(res.stderr)
            return Capability("io_uring runtime", False, "", why, lib.fix)
        try:
            done = run([str(exe), str(data), payload], _RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Capability("io_uring runtime", False, "", "a single io_uring read did not complete in "
                              f"{_RUN_TIMEOUT_S} s", "use the libaio or posix engine")
        if done.returncode != 0:
            msg = diagnose.tail(done.stderr or done.stdout, 3) or f"exit status {done.returncode}"
            return Capability("io_uring runtime", False, "", f"io_uring round trip failed: {msg}",
                              "io_uring is forbidden here (container seccomp profile, or sysctl "
                              "kernel.io_uring_disabled); allow it, or use the libaio/posix engine")
    return Capability("io_uring runtime", True,
                      f"ring init, read and reap worked (kernel {platform.release()})")


def io_uring_runtime() -> Capability:
    """Build and run a tiny program: ring init, one real read of a temp file, reap. Fails with the errno."""
    return _io_uring_runtime(env_key())
