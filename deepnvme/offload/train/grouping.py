"""Which optimizers may be stepped tile by tile, and the error for one that must be stepped whole.

Stepping a few parameters at a time (a tile: what the pool holds) gives the same arithmetic as one step
over all of them only when the optimizer updates each parameter from its own state and gradient alone. An
optimizer that reads or writes across a group (a norm clipped over the group, a trust ratio, a counter kept
in `param_groups` or in state not keyed by a parameter) computes something else per tile, silently. So
tiles are for the optimizers known to be element-wise (torch's own, listed here, matched by exact type: a
subclass may override `step`) or declared so by the caller (`elementwise=True`); any other is stepped
whole, every parameter in one call, which needs its whole state in the budget, or is refused before
anything moves.

Stepping one parameter a chunk of its elements at a time (records.py: a parameter larger than a tile)
takes more: each element updated from that element's state alone. torch's element-wise list does, and a
caller may declare it (`chunks=True`); Adafactor, or a LAMB-like trust ratio, updates a parameter from its
own state and gradient but through statistics of the whole parameter: tiles, each parameter whole.
`elementwise=True` declares the per-parameter kind only.
"""

from __future__ import annotations

import torch

#: torch.optim optimizers whose step updates each parameter from that parameter's state and gradient only.
ELEMENTWISE: frozenset[type] = frozenset(
    getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam",
                                            "RAdam", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name))
#: torch.optim optimizers that update each parameter from its own state and gradient, but not element-wise.
PER_PARAMETER: frozenset[type] = frozenset(
    getattr(torch.optim, name) for name in ("Adafactor",) if hasattr(torch.optim, name))


def how_stepped(optimizer: torch.optim.Optimizer, elementwise: bool | None,
                chunks: bool | None) -> tuple[bool, bool]:
    """(in tiles, parameters in chunks) for `optimizer`: what the caller declared, else what its type is
    known to allow."""
    for name, value in (("elementwise", elementwise), ("chunks", chunks)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True, False or None, got {type(value).__name__}")
    kind = type(optimizer)
    tiles = elementwise if elementwise is not None else kind in ELEMENTWISE or kind in PER_PARAMETER
    chunked = chunks if chunks is not None else tiles and kind in ELEMENTWISE
    if chunked and not tiles:
        raise ValueError("chunks=True needs an optimizer stepped a tile at a time: pass elementwise=True too "
                         f"if {kind.__name__} updates each parameter from its own state and gradient")
    return tiles, chunked


def whole_step_too_large(optimizer: torch.optim.Optimizer, need: int, capacity: int,
                         exact: bool = True) -> ValueError:
    """The error for an optimizer that must be stepped whole when its state does not fit the pool."""
    name = type(optimizer).__name__
    estimated = "" if exact else " (estimated: its step could not be tried ahead)"
    return ValueError(
        f"{name} is not known to update each parameter on its own (it may read or write across a group: a "
        f"norm, a trust ratio, a counter), so OffloadedOptimizer steps it whole, all its state in the pool "
        f"at once: that needs {need} bytes{estimated}, and budget_bytes gives {capacity}. Raise budget_bytes "
        "to at "
        f"least {need}, or pass elementwise=True if {name} updates each parameter from its own state and "
        "gradient alone (then it is stepped a tile at a time)")
