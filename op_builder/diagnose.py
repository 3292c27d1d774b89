"""Reading compiler and linker output: which header, library or function was missing, and the fix.

Used by the probes (a failed link test) and by the JIT build (a failed ninja run), so both say the same
thing about the same log.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = ["HEADER_PACKAGES", "build_fix", "explain_link_failure", "missing_header", "missing_library",
           "tail", "undefined_symbols"]

HEADER_PACKAGES = {"libaio.h": "libaio-dev", "liburing.h": "liburing-dev", "Python.h": "python3-dev",
                   "cufile.h": "nvidia-cufile (pip) or the CUDA toolkit's GDS package",
                   "cuda_runtime.h": "the CUDA toolkit (set CUDA_HOME)"}
DEFAULT_TAIL_LINES = 20


def tail(text: str, n: int = DEFAULT_TAIL_LINES) -> str:
    """The last lines that matter: drops ninja's command echoes and the bare file names of ``-Wl,-t``."""
    keep = [ln for ln in text.strip().splitlines()
            if ln.strip() and not re.match(r"\s*\[\d+/\d+\]", ln)
            and not ln.startswith("ninja: build stopped") and not re.fullmatch(r"\s*/\S+", ln)]
    return "\n".join(keep[-n:])


def missing_header(log: str) -> str | None:
    """The header a ``fatal error: X: No such file`` names, or None."""
    m = re.search(r"fatal error: ([^:\s]+): No such file", log)
    return m.group(1) if m else None


def missing_library(log: str) -> str | None:
    """The library a ``cannot find -lX`` (or ``-l:libX.so.N``) names, as given to -l, or None."""
    m = re.search(r"cannot find -l:?(\S+?)(?::|\s|$)", log)
    return m.group(1) if m else None


def undefined_symbols(log: str) -> set[str]:
    """Every symbol the linker called an undefined reference."""
    return set(re.findall(r"undefined reference to [`'\u2018]([^'`\u2019]+)['\u2019]", log))


def explain_link_failure(output: str, functions: Sequence[str], libraries: Sequence[str],
                         headers: Sequence[str]) -> str:
    """One sentence naming the missing piece of a failed compile-and-link test."""
    header = missing_header(output)
    if header:
        return f"header {header} not found"
    lib = missing_library(output)
    if lib:
        return f"library {lib} not found by the linker" if lib.startswith("lib") \
            else f"library lib{lib} not found by the linker"
    missing = sorted(undefined_symbols(output) & set(functions))
    if missing:
        where = f" in {', '.join('-l' + lib for lib in libraries)}" if libraries else ""
        return f"function(s) {', '.join(missing)} not found{where}"
    undeclared = sorted({fn for fn in functions
                         if re.search(rf"['\u2018]{re.escape(fn)}['\u2019] (?:undeclared|was not declared)",
                                      output)})
    if undeclared:
        return f"function(s) {', '.join(undeclared)} not declared by {', '.join(headers) or 'any header'}"
    return "compile/link check failed"


def build_fix(log: str) -> str:
    """What to do about a failed op build, from its log."""
    header = missing_header(log)
    if header:
        pkg = HEADER_PACKAGES.get(header) or HEADER_PACKAGES.get(os.path.basename(header))
        what = f"install {pkg}" if pkg else f"install the development package that provides {header}"
        return f"{what} (or add its directory with CFLAGS=-I<dir> and CPATH=<dir>)"
    lib = missing_library(log)
    if lib:
        return (f"install the development package for lib{lib.rstrip(':')} "
                "(or set LDFLAGS=-L<dir> / LIBRARY_PATH=<dir>)")
    if "undefined reference" in log or "undefined symbol" in log:
        return "a library is missing from the link: check extra_ldflags() (or set LDFLAGS)"
    return ("fix the error above; CXX selects the compiler, TORCH_EXTENSIONS_DIR the build folder, "
            "and load(verbose=True) shows every command")
