"""Ops prebuilt at install time (``DS_BUILD_*=1``): the record setup.py writes, and when one may be used.

The rule, in one place for load() and ds_report: a prebuilt op is used only when the torch (and CUDA)
running now is the one it was built against; otherwise it is JIT-built instead.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RECORD_MODULE", "installed_record", "torch_mismatch"]

RECORD_MODULE = "deepnvme._installed_ops"


def installed_record() -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(op name -> prebuilt?, the torch they were built for) as setup.py recorded them; ({}, None) when
    nothing was prebuilt."""
    try:
        mod = importlib.import_module(RECORD_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != RECORD_MODULE:
            raise
        return {}, None
    return dict(getattr(mod, "installed_ops", {}) or {}), getattr(mod, "torch_info", None)


def torch_mismatch(built: dict[str, Any] | None, running_version: str | None,
                   running_cuda: str | None) -> str:
    """Why a prebuilt op must not be used with the running torch, or "" when it may."""
    info = built or {}
    was = (info.get("version"), info.get("cuda_version"))
    if was == (running_version, running_cuda):
        return ""
    return (f"prebuilt for torch {was[0]} (CUDA {was[1]}), running torch {running_version} "
            f"(CUDA {running_cuda})")
