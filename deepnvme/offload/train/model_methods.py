"""Model-wide methods on a model whose parameters offload_parameters keeps on the drive:

- `model.load_state_dict(sd)` writes the values of offloaded parameters to the drive (shape checked, dtype
  converted as torch's copy_ would) and loads the rest as torch does; a shape that does not match is an
  error before anything is written;
- `model.to(...)`, `.half()`, `.float()`, `.cuda()` and every other conversion through `Module._apply` is
  tried on the stand-ins first: one that needs their values (a new dtype or device) is refused before any
  tensor of the model changes (a no-op such as `.to("cpu")` works as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from deepnvme.offload.model import Placeholder, StreamedWeightError
from deepnvme.offload.train.held import Held

if TYPE_CHECKING:
    from deepnvme.offload.train.params import OffloadedParameters


class ModelMethods:
    """The methods put on `owner.model` (see the module docstring); `remove()` takes them off."""

    def __init__(self, owner: OffloadedParameters) -> None:
        self.owner = owner
        self.loaded: list[str] = []
        self.held = {id(h.stand): h for u in owner.units for h in u.params}
        self.by_name = {n: h for n, p in owner.model.named_parameters(remove_duplicate=False)
                        if (h := self.held.get(id(p))) is not None}
        model = owner.model
        model._apply = self.apply  # type: ignore[method-assign]
        self.handles = [model.register_load_state_dict_pre_hook(self.before_load),
                        model.register_load_state_dict_post_hook(self.after_load)]

    def before_load(self, module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        wanted: dict[int, tuple[Held, list[str]]] = {}
        for n, h in self.by_name.items():
            if prefix + n in state_dict:
                wanted.setdefault(id(h), (h, []))[1].append(prefix + n)
        for h, keys in wanted.values():
            v = state_dict[keys[-1]]  # torch copies every key in turn: the last one stays
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(h.shape):
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise RuntimeError(f"load_state_dict: {keys[-1]} is {shape} in the state dict and "
                                   f"{tuple(h.shape)} in the model (nothing was loaded)")
        owner = self.owner
        with owner.lock:
            owner._check_open()
            busy = [u.name for u in owner.units if u.present or u.held]
            if busy:
                raise RuntimeError(f"load_state_dict during a forward or backward of unit {busy[0]!r}")
            for h, keys in wanted.values():
                owner._write([h], [state_dict[keys[-1]].detach().to(h.dtype)], [h.data])
                for key in keys:
                    del state_dict[key]
                    self.loaded.append(key)

    def after_load(self, module: Any, incompatible: Any) -> None:
        for key in self.loaded:
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
        self.loaded.clear()

    def apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> Any:
        tried = [(h, t) for h in self.held.values() for t in (h.stand, h.stand.grad)
                 if isinstance(t, Placeholder)]
        for h, t in tried:
            try:
                same = fn(t) is t
            except Exception as exc:  # noqa: BLE001 - any conversion that cannot run on a stand-in
                same, why = False, exc
            else:
                why = None
            if not same:
                raise StreamedWeightError(
                    f"this conversion of the model (.to(), .half(), .cuda() ...) would change {h.name}, "
                    "which lies on the drive (deepnvme.offload.offload_parameters): nothing was changed. "
                    "Convert the model before offloading it, or close() the offload first"
                    + (f" ({type(why).__name__})" if why is not None else "")) from why
        model = self.owner.model
        return type(model)._apply(model, fn, recurse)

    def remove(self) -> None:
        self.owner.model.__dict__.pop("_apply", None)
        for handle in self.handles:
            handle.remove()

    def __reduce__(self) -> Any:
        raise TypeError("a model whose parameters offload_parameters keeps on the drive cannot be pickled or "
                        "copied: save it with save() of the object offload_parameters returned (or close() "
                        "that first)")
