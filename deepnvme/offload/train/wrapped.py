"""How the wrapped optimizer is called: its own step without torch's hook wrapper (the offloaded
optimizer calls it once per tile and runs the hooks once per step), and whether it needs a closure."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` must be given a closure (LBFGS): it re-evaluates the whole model's loss."""
    try:
        closure = inspect.signature(unhooked(optimizer)).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def unhooked(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The optimizer class's own step, without the wrapper torch puts around it to run step hooks."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


def step_unhooked(optimizer: torch.optim.Optimizer) -> None:
    """One call of the wrapped optimizer's step on a tile: its step hooks run once per whole step instead
    (OffloadedOptimizer.step), not once per tile."""
    unhooked(optimizer)(optimizer)
