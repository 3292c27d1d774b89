"""MOELayer: gate -> index dispatch -> all-to-all -> experts -> all-to-all -> weighted combine."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from deepnvme.moe.comm import all_to_all
from deepnvme.moe.experts import Experts
from deepnvme.moe.gating import TopKGate
from deepnvme.moe.routing import combine, combine_per_expert, dispatch, dispatch_per_expert, uses_op


class MOELayer(nn.Module):
    """DeepSpeed's ``MOELayer`` (GShard-style dispatch), with the same attribute names (``gate``,
    ``experts``).

    Tokens are moved by index: each kept route copies its token row into an ``[E, C, M]`` buffer and the
    combine gathers rows back, so memory is O(E·C·M + S·k·M), never an ``S×E×C`` mask. With ``ep_size > 1``
    the buffer is exchanged over the expert-parallel group (chunk r of the E experts goes to EP rank r), each
    rank runs its ``num_local_experts`` experts on ``[ep, E_local, C, M]``, and a second exchange brings
    results back. At ``ep_size == 1``, with the compiled op and an unhooked :class:`Experts`, each expert gets
    a ``[1, 1, C, M]`` buffer of its own and its output goes to the combine as it is (nothing is split or
    concatenated around the experts). At inference (no autograd graph through the experts) and ``ep_size ==
    1``, experts that keep no token are not run at all (see :meth:`_active_experts`). After ``forward``,
    ``l_aux`` and ``exp_counts`` hold the batch's aux loss and per-expert counts.
    """

    def __init__(
        self,
        gate: TopKGate,
        experts: nn.Module,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.use_tutel = (
            False  # index dispatch already does what Tutel's kernels did; the flag is accepted only
        )
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None

    def _set_ep_group(self, ep_group: Any) -> None:
        """Attach the expert-parallel group to the layer and its gate."""
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        """``input[0]``: tokens ``[..., M]``; ``input[1]`` (optional): used_token mask. Returns ``input[0]``'s
        shape.
        """
        x = input[0]
        used_token = input[1] if len(input) > 1 else None
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel group; "
                "initialise torch.distributed before building the model or call set_deepspeed_parallelism()"
            )
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        c = routes.capacity
        active = self._active_experts(tokens, routes) if self.ep_size == 1 else None
        if (self.ep_size == 1 and isinstance(self.experts, Experts) and self.experts.runs_each_as_forward()
                and uses_op(tokens)):
            # One buffer per expert, each expert's output combined as it is: what the path below does, without
            # the split of one [E, C, M] buffer, the concatenation after the experts, and their backwards (the
            # compiled op reads and writes the buffers in place; the pure-torch path would copy them instead).
            blocks = dispatch_per_expert(tokens, routes.expert_idx, routes.slot, routes.num_experts, c,
                                         (1, 1, c, d_model))
            outs = self.experts.run_each(blocks, active)
            combined = combine_per_expert(outs, routes.expert_idx, routes.slot, routes.weight)
            return combined.reshape(x.shape[:-1] + combined.shape[-1:])
        buffer = dispatch(tokens, routes.expert_idx, routes.slot, routes.num_experts, c)
        buffer = all_to_all(buffer, self.ep_group)
        buffer = buffer.reshape(self.ep_size, self.num_local_experts, c, d_model)
        out = self.experts(buffer) if active is None else self.experts(buffer, active=active)
        if self.ep_size > 1:
            num_experts = self.ep_size * self.num_local_experts
            out = all_to_all(out.reshape(num_experts, c, out.shape[-1]), self.ep_group)
        # [ep, E_local, C, M] goes in as it is, not as a reshaped view: the combine's backward may reuse it.
        combined = combine(out, routes.expert_idx, routes.slot, routes.weight)
        return combined.reshape(x.shape[:-1] + combined.shape[-1:])

    def _active_experts(self, tokens: Tensor, routes: Any) -> list[bool] | None:
        """At inference, which experts keep at least one route (None: run them all).

        An expert with no kept route contributes no row to the combine, so not running it changes no bit of
        the output. "Inference" means no autograd graph is recorded through the experts (grad disabled, or
        neither the tokens nor any expert parameter needs a gradient): with one recorded, an idle expert's
        parameters get zero gradients, which optimisers treat differently from none, so every expert runs.
        Only this class's :class:`Experts` forward knows the flags; other expert modules run as they are.
        """
        if not isinstance(self.experts, Experts) or type(self.experts).forward is not Experts.forward:
            return None
        if torch.is_grad_enabled() and (tokens.requires_grad
                                        or any(p.requires_grad for p in self.experts.parameters())):
            return None
        kept = routes.expert_idx[routes.slot >= 0]
        counts = torch.bincount(kept.reshape(-1).long(), minlength=routes.num_experts)
        return [bool(n) for n in counts.tolist()]
