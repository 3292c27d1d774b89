"""The link test: compile and link a tiny C program that takes the address of each function asked for."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from . import diagnose
from .capability import Capability, cached_probe, env_key
from .toolchain import compiler_argv, conda_dirs, run, split_env

__all__ = ["COMPILE_TIMEOUT_S", "has_function"]

COMPILE_TIMEOUT_S = 120


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


@cached_probe
def _has_function(functions: tuple[str, ...], libraries: tuple[str, ...], headers: tuple[str, ...],
                  include_dirs: tuple[str, ...], library_dirs: tuple[str, ...],
                  extra_ldflags: tuple[str, ...],
                  verbose: bool, name: str, _env: tuple) -> Capability:
    label = name or ", ".join(functions)
    cc = compiler_argv()
    if not cc:
        return Capability(label, False, "", "no C compiler found (tried $CC, cc, gcc)",
                          "apt-get install build-essential (or set CC)")
    conda_inc, conda_lib = conda_dirs()
    with tempfile.TemporaryDirectory(prefix="deepnvme_probe_") as tmp:
        src = Path(tmp, "probe.c")
        src.write_text(_probe_source(functions, headers))
        argv = [*cc, *split_env("CFLAGS"), *conda_inc, *(f"-I{d}" for d in include_dirs),
                str(src), "-o", str(Path(tmp, "probe")),
                *split_env("LDFLAGS"), *conda_lib, *(f"-L{d}" for d in library_dirs),
                *(f"-l{lib}" for lib in libraries), *extra_ldflags, "-Wl,-t"]
        if verbose:
            print("deepnvme probe:", shlex.join(argv), file=sys.stderr)
        try:
            res = run(argv, COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return Capability(label, False, "", f"could not run the compiler {cc[0]!r}: {exc}",
                              "install a C compiler or set CC")
        out = (res.stdout or "") + (res.stderr or "")
        if verbose:
            print(out, file=sys.stderr)
        if res.returncode != 0:
            why = diagnose.explain_link_failure(out, functions, libraries, headers)
            return Capability(label, False, "", f"{why}; compiler said:\n{diagnose.tail(out)}",
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
                         tuple(map(str, library_dirs)), tuple(extra_ldflags), bool(verbose), name, env_key())
