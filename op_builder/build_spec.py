"""What one JIT build is made of, as plain values: the builder produces it, the JIT cache consumes it.

The cache (:mod:`.jit_cache`) keys, stamps, locks and builds from this description alone and never calls
back into a builder, as torch's versioner and file baton work on names, sources and flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BuildSpec"]


@dataclass(frozen=True)
class BuildSpec:
    """Everything a JIT build of one op depends on, resolved (absolute paths, final flag lists).

    ``probes`` are the capability outcomes the flags were computed from (recorded in the stamp, so that a
    later load computes the same flags without running a compiler); ``fingerprint`` is the stat-only identity
    of what those probes looked at (:func:`probe.state_fingerprint`), under which they stay valid.
    """

    name: str                    #: the op's name ("async_io")
    module_name: str             #: the extension module's name, also its build folder's
    origin: tuple[str, str]      #: (module, qualified name) of the builder class that described it
    version: str                 #: deepnvme's version
    sources: tuple[str, ...]     #: absolute paths
    include_dirs: tuple[str, ...]  #: absolute paths; every file under them is part of the key
    cxx_flags: tuple[str, ...]
    ld_flags: tuple[str, ...]
    nvcc_flags: tuple[str, ...] = ()
    with_cuda: bool = False
    fingerprint: str = ""
    probes: dict[str, Any] = field(default_factory=dict, compare=False)
