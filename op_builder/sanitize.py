"""Sanitizer builds of the ops, chosen by ``DEEPNVME_SANITIZE`` (``address,undefined`` or ``thread``).

A sanitized op is compiled with ``-fsanitize=...`` and built as a module of its own name in a folder of its
own (``deepnvme_async_io_asan_ubsan`` beside ``deepnvme_async_io``), so a sanitized and a normal build never
overwrite each other, and both can stay cached. A prebuilt (installed) op is never sanitized, so while the
switch is on only JIT builds are loaded. The builders add these flags in JIT mode only, and a prebuild
(``setup.py`` with ``DS_BUILD_OPS=1``, or ``OpBuilder.builder()``) refuses to run while the switch is set,
naming the variable: the prebuilt module keeps the op's normal name, so a sanitized one would silently be
what every later (unsanitized) run loads. Refusing, rather than ignoring the switch, keeps a user who asked
for a sanitizer from getting an unsanitized install without noticing.

Python itself is not built with a sanitizer, so the sanitizer's runtime must be loaded before anything else:
run Python through ``tests/sanitize/run.sh`` (which sets ``LD_PRELOAD`` and the ``*SAN_OPTIONS``), e.g.
``tests/sanitize/run.sh address,undefined python3 -m pytest -q tests/aio/test_aio_threads.py``.
Nothing here imports torch or runs a compiler.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["ENV", "PRELOADED_ENV", "SANITIZERS", "compile_flags", "compiler_environment", "link_flags",
           "module_suffix", "selected"]

ENV = "DEEPNVME_SANITIZE"
# What tests/sanitize/run.sh added to LD_PRELOAD (the sanitizer's runtime and libstdc++), so that it can be
# left out for the compilers.
PRELOADED_ENV = "DEEPNVME_SANITIZE_PRELOAD"
# The name a sanitizer has in folder and module names.
SANITIZERS = {"address": "asan", "undefined": "ubsan", "thread": "tsan"}


def selected() -> tuple[str, ...]:
    """The sanitizers ``$DEEPNVME_SANITIZE`` asks for, in a fixed order; () when unset or empty.

    Raises ValueError naming the variable for an unknown name, or for thread with address (their runtimes
    cannot share a process)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return ()
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - SANITIZERS.keys())
    if unknown:
        raise ValueError(f"{ENV}={text!r}: unknown sanitizer {', '.join(unknown)} "
                         f"(use a comma-separated subset of {', '.join(SANITIZERS)})")
    if "thread" in names and "address" in names:
        raise ValueError(f"{ENV}={text!r}: thread and address cannot be combined (use address,undefined "
                         "or thread)")
    return tuple(n for n in SANITIZERS if n in names)


def module_suffix() -> str:
    """``_asan_ubsan``, ``_tsan``... appended to a JIT module's name (and so to its build folder)."""
    return "".join(f"_{SANITIZERS[n]}" for n in selected())


def compile_flags() -> list[str]:
    """Flags added after the optimisation flags: later -O/-g win, so reports carry lines and full stacks."""
    names = selected()
    if not names:
        return []
    # -O1 keeps the instrumented code fast enough while not optimising away the accesses it checks.
    flags = [f"-fsanitize={','.join(names)}", "-O1", "-g", "-fno-omit-frame-pointer"]
    if "undefined" in names:
        flags.append("-fno-sanitize-recover=undefined")  # undefined behaviour ends the run, never just prints
    return flags


def link_flags() -> list[str]:
    """Linker flags: the shared library records its dependency on the sanitizer's runtime."""
    names = selected()
    return [f"-fsanitize={','.join(names)}"] if names else []


@contextlib.contextmanager
def compiler_environment() -> Iterator[None]:
    """Around a build: LD_PRELOAD without what tests/sanitize/run.sh put there for Python, so the compilers
    that ninja starts do not run under the sanitizer's runtime, which only slows them down (README,
    "Sanitizer builds")."""
    preload = os.environ.get("LD_PRELOAD")
    ours = set(os.environ.get(PRELOADED_ENV, "").split())
    if preload is None or not ours:
        yield
        return
    kept = [p for p in preload.split() if p not in ours]
    if kept:
        os.environ["LD_PRELOAD"] = " ".join(kept)
    else:
        del os.environ["LD_PRELOAD"]
    try:
        yield
    finally:
        os.environ["LD_PRELOAD"] = preload
