"""Which optimizers may be stepped tile by tile, and the error for one that must be stepped whole.

Stepping a few parameters at a time (a tile: what the pool holds) gives the same arithmetic as one step
over all of them only when the optimizer updates each parameter from its own state and gradient alone. An
optimizer that reads or writes across a group (a norm clipped over the group, a trust ratio, a counter kept
in `param_groups` or in state not keyed by a parameter) computes something else per tile, silently. So
tiles are for the optimizers known to be element-wise (torch's own, listed here, matched by exact type: a
subclass may override `step`) or declared so by the caller (`elementwise=True`); any other is stepped
whole, every parameter in one call, which needs its whole state in the budget, or is refused before
anything moves.
"""

from __future__ import annotations

import torch

#: torch.optim optimizers whose step updates each parameter from that parameter's state and gradient only.
ELEMENTWISE: frozenset[type] = frozenset(
    getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam",
                                            "RAdam", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name))


def is_elementwise(optimizer: torch.optim.Optimizer, declared: bool | None) -> bool:
    """Whether `optimizer` may be stepped tile by tile: what the caller declared, else whether its type is
    one of ELEMENTWISE."""
    if declared is not None:
        if not isinstance(declared, bool):
            raise TypeError(f"elementwise must be True, False or None, got {type(declared).__name__}")
        return declared
    return type(optimizer) in ELEMENTWISE


def whole_step_too_large(optimizer: torch.optim.Optimizer, need: int, capacity: int) -> ValueError:
    """The error for an optimizer that must be stepped whole when its state does not fit the pool."""
    name = type(optimizer).__name__
    return ValueError(
        f"{name} is not known to update each parameter on its own (it may read or write across a group: a "
        f"norm, a trust ratio, a counter), so OffloadedOptimizer steps it whole, all its state in the pool "
        f"at once: that needs {need} bytes, and budget_bytes gives {capacity}. Raise budget_bytes to at "
        f"least {need}, or pass elementwise=True if {name} updates each parameter from its own state and "
        "gradient alone (then it is stepped a tile at a time)")
