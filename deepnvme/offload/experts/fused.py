"""Running a Hugging Face fused experts module (experts/sets.py, kind ``fused``) on a few of its experts: the
module seen with only those experts' 3-D tensors (`FewExperts`), those tensors as one strided view of the
cached bytes when they lie so (`stack_views`), and whether a hook could see its results before they are
checked (`hooked_inside`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FewExperts:
    """An experts module seen with some attributes replaced (the few experts' tensors, their count): what its
    own forward is called with, as `self`, to run only the experts routed to."""

    def __init__(self, module: nn.Module, **over: Any) -> None:
        self.__dict__["_module"] = module
        self.__dict__.update(over)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def stack_views(views: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One tensor with dim 0 over `views` (same shape and dtype, contiguous, at increasing addresses one
    stride apart) without copying, or None when they do not lie so."""
    if not views or any(v is None for v in views):
        return None
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)  # type: ignore[union-attr]
    ptrs = [v.data_ptr() for v in views]  # type: ignore[union-attr]
    step = ptrs[1] - ptrs[0]
    size = first.element_size()  # type: ignore[union-attr]
    if (step <= 0 or step % size or any(b - a != step for a, b in zip(ptrs, ptrs[1:]))
            or any(v.shape != first.shape or v.dtype != first.dtype  # type: ignore[union-attr]
                   or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()  # type: ignore[union-attr]
                   for v in views)):
        return None
    return torch.as_strided(first, (len(views), *first.shape), (step // size, *first.stride()),  # type: ignore[union-attr]
                            first.storage_offset())  # type: ignore[union-attr]


def hooked_inside(module: nn.Module) -> bool:
    """Whether a hook could see what `module`'s forward computes before the forward returns: a forward
    (pre-)hook on a module inside it, or a global module hook. Hooks on `module` itself run outside it."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules() if m is not module)


__all__ = ["FewExperts", "hooked_inside", "stack_views"]
