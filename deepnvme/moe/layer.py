"""MoE: the user-facing Mixture-of-Experts layer, a drop-in for ``deepspeed.moe.layer.MoE``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepnvme._core.checks import check_int, check_type
from deepnvme.moe.experts import Experts, reinitialise
from deepnvme.moe.gating import TopKGate, check_gate_args
from deepnvme.moe.groups import create_expert_and_data_parallel_groups, expert_group_name
from deepnvme.moe.sharded_moe import MOELayer


def _one_layer_count(num_experts: Any) -> Any:
    """Unwrap a one-element list/tuple; a longer (per-layer, pyramid) list is for a model, not one layer."""
    if isinstance(num_experts, (list, tuple)):
        if len(num_experts) != 1:
            raise ValueError(
                f"num_experts: one MoE layer takes one expert count, got the list {list(num_experts)}; "
                "a per-layer list (the pyramid/PR-MoE form) belongs to the model: build layer i with "
                "num_experts[i]"
            )
        return num_experts[0]
    return num_experts


class MoE(nn.Module):
    """Mixture-of-Experts layer with DeepSpeed's constructor, attributes, state-dict keys and forward call.

    ``forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)``: ``output`` has the input's
    shape; ``l_aux`` is the fp32 load-balancing loss (1.0 at perfect balance) that the caller scales (e.g. by
    0.01) and adds to its loss; ``exp_counts`` [E] holds the tokens routed to each expert on this rank before
    dropping.

    Args (as DeepSpeed's): ``hidden_size`` model width M; ``expert`` any module mapping ``[..., M] -> [...,
    M]`` (deep-copied ``num_experts / ep_size`` times); ``num_experts`` E; ``ep_size`` expert-parallel degree;
    ``k`` experts per token (1, 2 or more); ``capacity_factor`` / ``eval_capacity_factor`` slots per expert
    relative to an even split, in train / eval mode; ``min_capacity`` floor for the capacity; ``use_residual``
    PR-MoE: ``y = moe(x)·c0 + mlp(x)·c1`` with ``c = softmax(coefficient(x))`` and ``mlp`` the given
    ``expert`` itself; ``noisy_gate_policy`` None | 'None' | 'Jitter' | 'RSample'; ``drop_tokens`` False means
    no capacity limit; ``use_rts`` random token selection when top-1 drops; ``use_tutel`` accepted and ignored
    (index dispatch is built in); ``enable_expert_tensor_parallelism`` accepted, no effect (there is no tensor
    parallelism here, as in DeepSpeed without an mpu); ``top2_2nd_expert_sampling`` Gumbel-sample the second
    expert (k=2).

    Keyword-only additions: ``distinct_experts`` (default True) re-initialises every expert copy from its own
    seed (``reset_parameters()`` of its submodules), derived from a peek at the global RNG (which is left as
    it was, so later modules initialise as after DeepSpeed's layer) plus the global expert id, so experts
    differ at init and expert g is the same whatever ``ep_size`` is; False keeps
    DeepSpeed's identical copies (needed for bit-for-bit parity with DeepSpeed, or to upcycle a trained dense
    MLP). With one expert the copy keeps the given weights. ``use_data_before_expert_parallel`` picks the rank
    layout of :mod:`deepnvme.moe.groups`. ``dropless`` (default False) keeps every route: no capacity, no
    padding, no token dropped; each expert computes exactly the rows routed to it, and with ``ep_size > 1``
    the all-to-all sends exactly those rows (``drop_tokens`` and the capacity factors are then ignored; the
    aux loss is computed as before). Experts that are Linear / Sequential-of-Linear-and-activation modules of
    one shape are computed together (:mod:`deepnvme.moe.grouped`), in either mode.

    Where DeepSpeed misbehaves, this layer differs (see also :mod:`deepnvme.moe.gating`):

    * ``num_experts`` as a list: DeepSpeed raises TypeError although its tutorial passes a list. A one-element
      list means that count; a longer list is a per-layer list and raises ValueError naming ``num_experts``.
    * ``drop_tokens=False`` never hangs across ranks: the capacity is agreed (MAX) over the expert-parallel
      group and not clamped to the local token count afterwards (DeepSpeed #6809). With dropping on, C is
      agreed too, so ranks with different token counts still meet in the all-to-all (one 8-byte all-reduce).
    * No ``tokens >= min_capacity`` assertion (a 1–3 token decode step works).
    * Experts start different (``distinct_experts``), and routing is deterministic in eval mode.
    * ``used_token`` is honoured for every k (DeepSpeed honours it for k=1 only).
    * Bad arguments raise ValueError naming the argument instead of asserting.

    Expert parallelism: with ``ep_size > 1`` torch.distributed must be initialised before the layer is built;
    the layer creates the ``ep_size_{ep}`` groups itself and ``ep_rank`` tells which experts it holds (local
    expert i is global expert ``ep_rank * num_local_experts + i``). Ranks seeded differently call
    :func:`deepnvme.moe.broadcast_moe_parameters` once; after each backward, call
    :func:`deepnvme.moe.allreduce_moe_gradients` (both what DeepSpeed's engine does) instead of using DDP.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        distinct_experts: bool = True,
        use_data_before_expert_parallel: bool = False,
        dropless: bool = False,
    ) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        check_type("expert", expert, nn.Module)
        num_experts = _one_layer_count(num_experts)
        check_gate_args(
            num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy
        )
        check_int("ep_size", ep_size, 1)
        if num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        if use_tutel:
            warnings.warn("use_tutel: ignored; deepnvme.moe dispatches by index without Tutel", stacklevel=2)
        if noisy_gate_policy == "RSample" and k != 1:
            warnings.warn("noisy_gate_policy='RSample' only affects k=1 (as in DeepSpeed)", stacklevel=2)

        self.use_residual = bool(use_residual)
        self.enable_expert_tensor_parallelism = bool(enable_expert_tensor_parallelism)
        self.ep_size = ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.k = k
        self._data_before_expert = bool(use_data_before_expert_parallel)

        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
            dropless=dropless,
        )
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

        # This rank's index in its EP group: local expert i is global expert ep_rank * num_local_experts + i.
        self.ep_rank = 0
        if ep_size > 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            self.ep_rank = self.set_deepspeed_parallelism(self._data_before_expert)
        if distinct_experts and self.num_experts > 1:
            # A peek at the global CPU RNG (identical on ranks seeded alike), after the gate and coefficient
            # took their draws; the state is restored, so every module built after this layer initialises
            # as it would after DeepSpeed's for the same seed.
            with torch.random.fork_rng(devices=[]):
                base = int(torch.randint(0, 2**31 - 1, (1,)).item())
            first = self.ep_rank * self.num_local_experts
            done = [reinitialise(e, base + first + i) for i, e in enumerate(experts.deepspeed_experts)]
            if not all(done):
                warnings.warn(
                    "expert: no submodule has reset_parameters(); experts stay identical", stacklevel=2
                )

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> int:
        """Create (or reuse) the ``ep_size_{ep}`` groups and attach the EP group; returns this rank's EP
        index.

        Called by the constructor; calling it again (as DeepSpeed's engine does) is harmless.
        """
        groups = create_expert_and_data_parallel_groups(self.ep_size, use_data_before_expert_parallel_)
        if groups.ep_group is not None:
            self.deepspeed_moe._set_ep_group(groups.ep_group)
        return groups.ep_rank

    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Route, run the experts, combine; see the class docstring for the returned triple."""
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.deepspeed_moe.gate.wg.in_features:
            raise ValueError(
                f"hidden_states must end in hidden_size={self.deepspeed_moe.gate.wg.in_features}, "
                f"got {tuple(hidden_states.shape)}"
            )
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
