"""ALL_OPS: deepnvme's ops, then plugins from the ``deepnvme.op_builders`` entry points, then register()."""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import Any

from .builder import OpBuilder

__all__ = ["ENTRY_POINT_GROUP", "all_ops", "register"]

ENTRY_POINT_GROUP = "deepnvme.op_builders"

_all_ops: dict[str, OpBuilder] | None = None
_registered: list[OpBuilder] = []


def _instantiate(obj: Any) -> OpBuilder:
    builder = obj() if isinstance(obj, type) else obj
    if not isinstance(builder, OpBuilder):
        raise TypeError(f"{obj!r} is not an OpBuilder subclass or instance")
    return builder


def _builtins() -> dict[str, OpBuilder]:
    from .async_io import AsyncIOBuilder
    from .gds import GDSBuilder
    from .moe import MoEBuilder
    from .pin_memory import PinMemoryBuilder

    return {"async_io": AsyncIOBuilder(), "gds": GDSBuilder(), "pin_memory": PinMemoryBuilder(),
            "moe": MoEBuilder()}


def _entry_points() -> list[metadata.EntryPoint]:
    eps = metadata.entry_points()
    found = eps.select(group=ENTRY_POINT_GROUP) if hasattr(eps, "select") else eps.get(ENTRY_POINT_GROUP, [])
    unique: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in found:  # the same distribution may sit twice on sys.path
        unique.setdefault((ep.name, ep.value), ep)
    return list(unique.values())


def _add(ops: dict[str, OpBuilder], builder: OpBuilder, origin: str, strict: bool) -> None:
    current = ops.get(builder.name)
    if current is not None and type(current) is not type(builder):
        msg = (f"deepnvme: op name '{builder.name}' from {origin} is already taken by "
               f"{type(current).__module__}.{type(current).__qualname__}")
        if strict:
            raise ValueError(msg)
        warnings.warn(msg + "; skipping it", RuntimeWarning, stacklevel=3)
        return
    ops.setdefault(builder.name, builder)


def all_ops() -> dict[str, OpBuilder]:
    """The one ALL_OPS dict, built on first use (no probe runs here)."""
    global _all_ops
    if _all_ops is None:
        ops = _builtins()
        for ep in _entry_points():
            try:
                builder = _instantiate(ep.load())
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break deepnvme
                warnings.warn(f"deepnvme: skipping op plugin {ep.name} = {ep.value}: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
                continue
            _add(ops, builder, f"entry point {ep.name} = {ep.value}", strict=False)
        for builder in _registered:
            _add(ops, builder, "register()", strict=False)
        _all_ops = ops
    return _all_ops


def register(builder: Any) -> Any:
    """Add an OpBuilder subclass (or instance) to ALL_OPS; usable as a class decorator.

    Raises ValueError when another builder class already owns the name.
    """
    instance = _instantiate(builder)
    if _all_ops is not None:
        _add(_all_ops, instance, "register()", strict=True)
    else:
        for other in _registered:
            if other.name == instance.name and type(other) is not type(instance):
                raise ValueError(f"deepnvme: op name '{instance.name}' is already registered")
    _registered.append(instance)
    return builder
