"""Running a Hugging Face fused experts module (experts/sets.py, kind ``fused``) on a few of its experts: the
module seen with only those experts' 3-D tensors (`FewExperts`; they are one strided view of the cached
bytes when they lie so: deepnvme.moe.grouped.stack_views), and whether a hook could see its results before
they are checked (`hooked_inside`)."""

from __future__ import annotations

from typing import Any

from torch import nn


class FewExperts:
    """An experts module seen with some attributes replaced (the few experts' tensors, their count): what its
    own forward is called with, as `self`, to run only the experts routed to."""

    def __init__(self, module: nn.Module, **over: Any) -> None:
        self.__dict__["_module"] = module
        self.__dict__.update(over)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def hooked_inside(module: nn.Module) -> bool:
    """Whether a hook could see what `module`'s forward computes before the forward returns: a forward
    (pre-)hook on a module inside it, or a global module hook. Hooks on `module` itself run outside it."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules() if m is not module)


__all__ = ["FewExperts", "hooked_inside"]
