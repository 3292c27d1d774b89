"""A module fully_shard was applied to whose shards hold no element on this rank (a small head or norm
sharded over many ranks): nothing of it is read or written here, but the other ranks agree on its hooks
(rank_errors.agree), so this rank agrees at the same points, with nothing to say. The points are those
of an offloaded unit's hooks (shards.py): the forward's pre- and post-hook, once per backward on its
outputs' gradients, once its backward is done (an identity on its inputs), and not the forward's
identities during a recompute in its backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from deepnvme.offload.train.rank_errors import agree
from deepnvme.offload.train.unit_hooks import BackwardEnds, through


def _nothing() -> None:
    return None


class Bystander:
    """The hooks of `module` on a rank that holds none of its shards' elements, agreeing on `group`."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.group = group
        self.in_backward = -1  # the graph task of the backward it is in (-1: none)
        self.handles = [module.register_forward_pre_hook(self._pre, prepend=True, with_kwargs=True),
                        module.register_forward_hook(self._post, prepend=True)]

    def _pre(self, _mod: nn.Module, args: Any, kwargs: Any) -> Any:
        agree(_nothing, self.group)
        if torch._C._current_graph_task_id() == -1:  # not a recompute: a backward left part way is over
            self.in_backward = -1
        if self.in_backward == -1 and torch.is_grad_enabled():
            args, kwargs = through(BackwardEnds, self._ends, (args, kwargs))
        return args, kwargs

    def _post(self, _mod: nn.Module, _args: Any, output: Any) -> Any:
        agree(_nothing, self.group)
        if self.in_backward != -1:
            return output
        needs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = [-1]

        def begins(grad: torch.Tensor) -> torch.Tensor:
            task = torch._C._current_graph_task_id()
            if fired[0] != task:
                fired[0] = task
                self.in_backward = task
                agree(_nothing, self.group)
            return grad

        for t in {id(t): t for t in needs}.values():
            t.register_hook(begins)
        return output

    def _ends(self) -> None:
        self.in_backward = -1
        agree(_nothing, self.group)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


__all__ = ["Bystander"]
