"""What a streamed tensor is between forwards: a Placeholder with the true shape, dtype and device and no
storage, so that code asking a model's device or dtype works while any computation with it raises
StreamedWeightError naming the tensor and its unit (shared by weight streaming and expert streaming).
Making a new tensor shaped like it (zeros_like and the like: what optimizers such as Adagrad do to a
parameter when they are made) reads no value and works."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class StreamedWeightError(RuntimeError):
    """A streamed tensor was used outside the forward of its unit."""


_aten = torch.ops.aten
# Operations that make a new tensor from another's shape, dtype and device alone.
SHAPED_LIKE = {_aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default,
               _aten.full_like.default}


class Placeholder(torch.Tensor):
    """Stands for a streamed tensor between forwards: shape, dtype and device are the real ones (code that
    asks `model.device` or `model.dtype` works); any computation raises StreamedWeightError naming it."""

    _name: str
    _unit: str

    @staticmethod
    def __new__(cls, name: str, unit: str, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device, requires_grad: bool = False) -> Placeholder:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                requires_grad=requires_grad)
        t._name, t._unit = name, unit
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SHAPED_LIKE and isinstance(args[0], Placeholder):
            a = args[0]
            like = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            return func(like, *args[1:], **(kwargs or {}))
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Placeholder)]
        what = found[0] if found else None
        name = what._name if what is not None else "a streamed tensor"
        unit = what._unit if what is not None else "?"
        raise StreamedWeightError(cls._explain(name, unit, func))

    @classmethod
    def _explain(cls, name: str, unit: str, func: Any) -> str:
        """Why `func` cannot run on the tensor `name` of `unit` (a subclass says it for its own users)."""
        return (f"{name} is streamed from the drive by deepnvme.offload.stream_weights: its values exist "
                f"only during the forward of unit {unit!r} ({func} was called outside it); run the model, or "
                "call deepnvme.offload.unstream(model) to have the weights in memory again")

    def __repr__(self, **_: Any) -> str:  # type: ignore[override]
        return (f"Placeholder({self._name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, streamed by deepnvme.offload)")
