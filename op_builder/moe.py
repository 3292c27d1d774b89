"""The moe op: capacity slots and index dispatch/combine of Mixture-of-Experts routes (CPU, C++17)."""

from __future__ import annotations

from .builder import TorchCPUOpBuilder, csrc_root

__all__ = ["MoEBuilder"]


class MoEBuilder(TorchCPUOpBuilder):
    """Builds the routing kernels behind ``deepnvme.moe.routing``; needs only a C++ compiler and torch."""

    NAME = "moe"
    BUILD_VAR = "DS_BUILD_MOE"
    BUILTIN_SOURCES = True

    def sources(self) -> list[str]:
        return [f"csrc/moe/{p.name}" for p in sorted((csrc_root() / "moe").glob("*.cpp"))]

    def include_paths(self) -> list[str]:
        return ["csrc/moe"]

    def cxx_args(self) -> list[str]:
        # No fused multiply-add: each product is rounded on its own, as torch's separate mul and add round
        # it, so the op and the pure-torch path give the same sums.
        return [*super().cxx_args(), "-ffp-contract=off"]
