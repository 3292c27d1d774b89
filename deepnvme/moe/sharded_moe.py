"""MOELayer: gate -> index dispatch -> all-to-all -> experts -> all-to-all -> weighted combine."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from deepnvme.moe.comm import all_to_all, all_to_all_rows, exchange_counts
from deepnvme.moe.experts import Experts
from deepnvme.moe.gating import TopKGate
from deepnvme.moe.grouped import GroupedExperts, choose
from deepnvme.moe.routing import combine, combine_per_expert, dispatch, dispatch_per_expert, uses_op
from deepnvme.moe.rows import Regroup, expert_rows


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

    When the experts qualify (:mod:`deepnvme.moe.grouped`) they are computed together: at ``ep_size == 1``
    on each expert's kept rows only (:mod:`deepnvme.moe.rows`; the padding up to C is never computed), or
    on the padded buffer with one ``baddbmm`` where that is the choice (``bmm``); with
    ``ep_size > 1`` on each local expert's exchanged ``ep*C`` rows. A dropless gate
    (``gate.dropless``) sends exactly the kept rows: at ``ep_size > 1`` through a variable all-to-all
    whose row counts are exchanged first. ``last_path`` names the path the last forward took.
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
        self.last_path = ""

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
        dropless = bool(getattr(self.gate, "dropless", False))
        if dropless and not isinstance(self.experts, Experts):
            raise TypeError(f"a dropless gate needs deepnvme.moe.Experts as experts, got "
                            f"{type(self.experts).__name__}")
        impl = choose(tokens.device, tokens.dtype)
        plan, streamed = self._plan(tokens, impl)
        if self.ep_size > 1:
            out = (self._rows_across_ranks(tokens, routes, plan, impl) if dropless
                   else self._padded_across_ranks(tokens, routes, plan, impl))
        elif dropless or streamed or (plan is not None and impl != "bmm"):
            out = self._rows(tokens, routes, plan, impl, streamed)
        else:
            out = self._padded(tokens, routes, plan)
        return out.reshape(x.shape[:-1] + out.shape[-1:])

    def _plan(self, tokens: Tensor, impl: str) -> tuple[GroupedExperts | None, bool]:
        """(the experts' grouped plan, or None; whether a weight streamer computes them grouped instead).
        A streamed layer takes the path the same layer in memory would: the streamer's placeholders stand
        for its tensors when deciding, and where memory would run the loop over padded blocks (a hook,
        autocast, the bmm choice) the streamed layer does too."""
        if impl == "loop" or not isinstance(self.experts, Experts):
            return None, False
        if self.experts.run_streamed is not None:
            return None, impl != "bmm" and self.experts.grouped(tokens, streamed=True) is not None
        return self.experts.grouped(tokens), False

    def _rows(self, tokens: Tensor, routes: Any, plan: GroupedExperts | None, impl: str,
              streamed: bool = False) -> Tensor:
        """ep_size 1: every kept route's token in a row of its own, grouped by expert (no padding), the
        experts on those rows, the weighted combine."""
        rows = expert_rows(routes.expert_idx, routes.slot, routes.num_experts)
        buffer = dispatch(tokens, rows.index, rows.slot, 1, rows.total)
        flat = buffer.view(rows.total, tokens.shape[1])
        self.experts._announce([n > 0 for n in rows.counts])
        out = None
        if plan is not None:
            out = plan.run(flat, rows.counts, impl)
            self.last_path = f"rows, {impl}"
        elif streamed:
            out = self.experts.run_streamed(flat, rows.counts, impl)
            self.last_path = f"rows, streamed {impl}"
        if out is None:
            active = [n > 0 for n in rows.counts] if self._inference(tokens) else None
            out = self.experts.run_rows(flat, rows.counts, active, announce=False)
            self.last_path = "rows, loop"
        return combine(out.view(1, rows.total, out.shape[-1]), rows.index, rows.slot, routes.weight)

    def _padded(self, tokens: Tensor, routes: Any, plan: GroupedExperts | None) -> Tensor:
        """ep_size 1: the ``[E, C, M]`` capacity buffer through the experts (one baddbmm per Linear with a
        plan, else each expert on its block)."""
        c, d_model = routes.capacity, tokens.shape[1]
        active = self._active_experts(tokens, routes)
        if plan is not None:
            self.experts._announce([True] * routes.num_experts if active is None else active)
            buffer = dispatch(tokens, routes.expert_idx, routes.slot, routes.num_experts, c)
            self.last_path = "padded, bmm"
            return combine(plan.run_padded(buffer), routes.expert_idx, routes.slot, routes.weight)
        if isinstance(self.experts, Experts) and self.experts.runs_each_as_forward() and uses_op(tokens):
            # One buffer per expert, each expert's output combined as it is: what the path below does, without
            # the split of one [E, C, M] buffer, the concatenation after the experts, and their backwards (the
            # compiled op reads and writes the buffers in place; the pure-torch path would copy them instead).
            blocks = dispatch_per_expert(tokens, routes.expert_idx, routes.slot, routes.num_experts, c,
                                         (1, 1, c, d_model))
            outs = self.experts.run_each(blocks, active)
            self.last_path = "padded, loop per block"
            return combine_per_expert(outs, routes.expert_idx, routes.slot, routes.weight)
        buffer = dispatch(tokens, routes.expert_idx, routes.slot, routes.num_experts, c)
        buffer = buffer.reshape(1, self.num_local_experts, c, d_model)
        out = self.experts(buffer) if active is None else self.experts(buffer, active=active)
        self.last_path = "padded, loop"
        return combine(out, routes.expert_idx, routes.slot, routes.weight)

    def _padded_across_ranks(self, tokens: Tensor, routes: Any, plan: GroupedExperts | None,
                             impl: str) -> Tensor:
        """ep_size > 1: the capacity buffer exchanged over the group (equal chunks), the local experts on
        ``[ep, E_local, C, M]`` (grouped: each local expert's ep*C rows, as the loop gives them to it),
        exchanged back, combined."""
        c, d_model = routes.capacity, tokens.shape[1]
        buffer = dispatch(tokens, routes.expert_idx, routes.slot, routes.num_experts, c)
        buffer = all_to_all(buffer, self.ep_group)
        buffer = buffer.reshape(self.ep_size, self.num_local_experts, c, d_model)
        if plan is not None:
            self.experts._announce([True] * self.num_local_experts)
            local = buffer.transpose(0, 1).reshape(self.num_local_experts, self.ep_size * c, d_model)
            if impl == "bmm":
                out = plan.run_padded(local)
            else:
                rows = self.ep_size * c
                out = plan.run(local.reshape(-1, d_model), [rows] * self.num_local_experts, impl)
            out = out.reshape(self.num_local_experts, self.ep_size, c, -1).transpose(0, 1)
            self.last_path = f"padded across ranks, {impl}"
        else:
            out = self.experts(buffer)
            self.last_path = "padded across ranks, loop"
        num_experts = self.ep_size * self.num_local_experts
        out = all_to_all(out.reshape(num_experts, c, out.shape[-1]), self.ep_group)
        return combine(out, routes.expert_idx, routes.slot, routes.weight)

    def _rows_across_ranks(self, tokens: Tensor, routes: Any, plan: GroupedExperts | None,
                           impl: str) -> Tensor:
        """ep_size > 1, dropless: each rank's rows for each expert-parallel rank sent as they are (a variable
        all-to-all after one exchange of the row counts), regrouped by local expert, computed, sent back."""
        rows = expert_rows(routes.expert_idx, routes.slot, routes.num_experts)
        buffer = dispatch(tokens, rows.index, rows.slot, 1, rows.total).view(rows.total, tokens.shape[1])
        sent = torch.tensor(rows.counts, dtype=torch.int64, device=tokens.device).view(
            self.ep_size, self.num_local_experts)
        got = exchange_counts(sent, self.ep_group)
        send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
        arrived = all_to_all_rows(buffer, send, recv, self.ep_group)
        regroup = Regroup(got.to(tokens.device))
        local = regroup.to_experts(arrived)
        if plan is not None:
            self.experts._announce([True] * self.num_local_experts)
            out = plan.run(local, regroup.counts, impl)
            self.last_path = f"rows across ranks, {impl}"
        else:
            out = self.experts.run_rows(local, regroup.counts)
            self.last_path = "rows across ranks, loop"
        back = all_to_all_rows(regroup.to_ranks(out), recv, send, self.ep_group)
        return combine(back.view(1, rows.total, back.shape[-1]), rows.index, rows.slot, routes.weight)

    def _inference(self, tokens: Tensor) -> bool:
        """No autograd graph is recorded through the experts: grad disabled, or neither the tokens nor any
        expert parameter needs a gradient (see :meth:`_active_experts`)."""
        return not (torch.is_grad_enabled() and (tokens.requires_grad
                                                 or any(p.requires_grad for p in self.experts.parameters())))

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
        if not self._inference(tokens):
            return None
        kept = routes.expert_idx[routes.slot >= 0]
        counts = torch.bincount(kept.reshape(-1).long(), minlength=routes.num_experts)
        return [bool(n) for n in counts.tolist()]
