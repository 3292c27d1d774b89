"""Experts: the local expert modules of one MoE layer, tagged so optimisers and reducers tell them apart;
how their parameters are named in a state dict, and which of a layer's experts this rank holds."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from deepnvme._core.checks import check_int, check_type
from deepnvme.moe.grouped import GroupedExperts, is_packed, pack

# DeepSpeed's state_dict naming of a rank-local expert inside an MoE layer.
EXPERT_KEY = re.compile(
    r"^(?P<layer>.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<local>\d+)\.(?P<rest>.*)$"
)


def reinitialise(module: nn.Module, seed: int) -> bool:
    """Re-run ``reset_parameters()`` of every submodule that has one, drawing from a private RNG seeded
    ``seed``.

    The global CPU (and the module's CUDA) RNG state is left as it was. Returns False when no submodule could
    be reset, i.e. the module keeps the weights it had.
    """
    resettable = [m for m in module.modules() if callable(getattr(m, "reset_parameters", None))]
    if not resettable:
        return False
    cuda = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with torch.no_grad():
            for m in resettable:
                m.reset_parameters()
    return True


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` in ``deepspeed_experts`` (DeepSpeed's attribute name).

    Every parameter gets ``allreduce = False`` and ``group_name = expert_group_name``: that tag is what
    :func:`deepnvme.moe.is_moe_param` and the optimiser-group helpers look for, exactly as in DeepSpeed.

    The copies start identical, as in DeepSpeed; :class:`deepnvme.moe.MoE` re-initialises them with
    :func:`reinitialise` unless told not to.

    ``forward`` takes ``[..., num_local_experts * n, ...]`` split along dim 1 into one chunk per expert (the
    MoE layer passes ``[ep, E_local, C, M]``, so each expert sees ``[ep, 1, C, M]``); an expert returning a
    tuple contributes its first element.

    The copies' parameters are packed (:func:`deepnvme.moe.grouped.pack`: each name's tensors are slices of
    one ``[E, ...]`` storage, again after ``.to()`` and the like), so that :meth:`grouped` can multiply them
    all at once without stacking copies.
    """

    def __init__(
        self,
        expert: nn.Module,
        num_local_experts: int = 1,
        expert_group_name: str | None = None,
    ) -> None:
        super().__init__()
        check_type("expert", expert, nn.Module)
        check_int("num_local_experts", num_local_experts)
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        # Called with the indices of the experts about to run, before the first runs (a weight streamer
        # reads exactly those ahead: deepnvme.offload.experts). None: nothing is told.
        self.before_run: Callable[[list[int]], None] | None = None
        # Set by a weight streamer whose experts' tensors are placeholders: computes rows grouped by expert
        # (as GroupedExperts.run does) with the experts' tensors it holds, or returns None to leave them to
        # run_rows (the experts' own forwards then read them one by one).
        self.run_streamed: Callable[[Tensor, list[int], str], Tensor | None] | None = None
        pack(self.deepspeed_experts)
        self._plan: tuple[tuple, GroupedExperts | None] | None = None  # (GroupedExperts.key, plan)
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False
                p.group_name = expert_group_name

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        """``nn.Module._apply`` (``.to()``, ``.half()``, ...), then the parameters packed again where the
        conversion gave every tensor storage of its own (not after one that kept them in place, such as
        ``share_memory()``)."""
        out = super()._apply(fn, recurse)
        if not is_packed(self.deepspeed_experts):
            pack(self.deepspeed_experts)
        return out

    def grouped(self, x: Tensor, streamed: bool = False) -> GroupedExperts | None:
        """The experts as one :class:`~deepnvme.moe.grouped.GroupedExperts` when computing them together on
        rows like ``x`` gives what calling each would (see its ``ready``; ``streamed`` as there), else
        None. The plan is kept from call to call while the expert modules stay the same."""
        if not self.runs_each_as_forward():
            return None
        key = GroupedExperts.key(self.deepspeed_experts)
        if self._plan is None or self._plan[0] != key:
            plan = GroupedExperts.of(self.deepspeed_experts)
            if plan is not None:
                plan.repack = lambda: pack(self.deepspeed_experts)
            self._plan = (key, plan)
        plan = self._plan[1]
        return plan if plan is not None and plan.ready(x, streamed) else None

    def run_rows(self, rows: Tensor, counts: list[int], active: list[bool] | None = None,
                 announce: bool = True) -> Tensor:
        """Rows grouped by expert (``counts[e]`` rows of expert e, in order) through each expert module in
        turn: the reference for the grouped computation. Experts whose ``active`` flag is False are not run
        (they must have no rows); with every expert idle the result is ``rows`` itself, empty."""
        if len(counts) != self.num_local_experts or sum(counts) != rows.shape[0]:
            raise ValueError(f"counts must give {self.num_local_experts} group sizes summing to "
                             f"{rows.shape[0]} rows, got {counts}")
        flags = self._check_active(active)
        if any(n and not run for n, run in zip(counts, flags)):
            raise ValueError("active: an expert with rows must run")
        if announce:
            self._announce(flags)
        outputs = []
        for chunk, expert, run in zip(rows.split(counts), self.deepspeed_experts, flags):
            if run:
                out = expert(chunk)
                outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs) if outputs else rows

    def run_each(self, inputs: list[Tensor] | tuple[Tensor, ...],
                 active: list[bool] | None = None) -> list[Tensor]:
        """Run local expert i on ``inputs[i]`` (one buffer per expert, as the MoE layer dispatches them) and
        return their outputs (a tuple output contributes its first element): what :meth:`forward` does
        without splitting one tensor and concatenating the results.

        ``active`` (one flag per expert) leaves the experts flagged False unrun: their outputs are one
        shared tensor of zeros shaped like the others', for a caller that never reads them (an expert that
        received no tokens, at inference)."""
        if len(inputs) != self.num_local_experts:
            raise ValueError(
                f"inputs must hold {self.num_local_experts} tensors, one per expert, got {len(inputs)}"
            )
        flags = self._check_active(active)
        self._announce(flags)
        outputs: list[Tensor | None] = []
        for chunk, expert, run in zip(inputs, self.deepspeed_experts, flags):
            if not run:
                outputs.append(None)
                continue
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return _fill_idle(outputs, inputs)

    def _check_active(self, active: list[bool] | None) -> list[bool]:
        if active is None:
            return [True] * self.num_local_experts
        if len(active) != self.num_local_experts:
            raise ValueError(f"active must hold {self.num_local_experts} flags, one per expert, "
                             f"got {len(active)}")
        return [bool(a) for a in active]

    def _announce(self, flags: list[bool]) -> None:
        if self.before_run is not None:
            self.before_run([i for i, run in enumerate(flags) if run])

    def runs_each_as_forward(self) -> bool:
        """Whether :meth:`run_each` stands in for a call of this module: its ``forward`` is this class's and
        no hook would miss the call (hooks on the module itself, or global module hooks)."""
        from torch.nn.modules import module as nn_module

        hooks = (self._forward_hooks, self._forward_pre_hooks, self._backward_hooks, self._backward_pre_hooks,
                 nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
                 nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)
        return type(self).forward is Experts.forward and not any(hooks)

    def forward(self, inputs: Tensor, active: list[bool] | None = None) -> Tensor:
        """Run each local expert on its chunk of dim 1 and concatenate the results along dim 1; experts
        whose ``active`` flag is False are not run and contribute zeros (see :meth:`run_each`)."""
        if inputs.dim() < 2 or inputs.shape[1] % self.num_local_experts:
            raise ValueError(
                f"inputs dim 1 must split into {self.num_local_experts} expert chunks, "
                f"got {tuple(inputs.shape)}"
            )
        flags = self._check_active(active)
        self._announce(flags)
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs: list[Tensor | None] = []
        for chunk, expert, run in zip(chunks, self.deepspeed_experts, flags):
            if not run:
                outputs.append(None)
                continue
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(_fill_idle(outputs, chunks), dim=1)


def _fill_idle(outputs: list[Tensor | None], inputs: list[Tensor] | tuple[Tensor, ...]) -> list[Tensor]:
    """`outputs` with each None (an expert not run) replaced by one shared zero tensor shaped like the
    outputs that were computed, or like the inputs when none was (experts map [..., M] to [..., M])."""
    if all(o is not None for o in outputs):
        return outputs  # type: ignore[return-value]
    like = next((o for o in outputs if o is not None), None)
    if like is None:
        zeros = torch.zeros_like(inputs[0])
    else:
        zeros = like.new_zeros(inputs[0].shape[:-1] + like.shape[-1:])
    return [zeros if o is None else o for o in outputs]


def expert_ranks(layer: nn.Module) -> tuple[int, int]:
    """(expert-parallel rank, expert-data-parallel rank) of this process for the MoE `layer`.

    The EP rank says which experts it holds (local expert i is global expert ep_rank * E_local + i); EDP rank
    0 marks the first of the ranks holding the same experts. Without torch.distributed both are 0.
    """
    import torch.distributed as dist

    from deepnvme.moe.groups import groups_named

    groups = groups_named(layer.expert_group_name)
    if groups is None:
        if layer.ep_size > 1:
            raise ValueError(f"MoE layer with ep_size={layer.ep_size} has no expert-parallel groups")
        return 0, 0
    return groups.ep_rank, (dist.get_rank(groups.edp_group) if groups.edp_group is not None else 0)
