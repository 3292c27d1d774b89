"""deepnvme.moe: DeepSpeed's Mixture-of-Experts layer on plain torch and torch.distributed.

Code written against ``deepspeed.moe.layer.MoE`` runs with only the import changed::

    from deepnvme.moe import MoE
    moe = MoE(hidden_size=512, expert=mlp, num_experts=8, k=2)
    out, l_aux, exp_counts = moe(x)
    loss = task_loss + 0.01 * l_aux          # the caller scales and adds the aux loss, as in DeepSpeed

State-dict keys are DeepSpeed's (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<i>.…``, ``mlp.…``, ``coefficient.…``), so checkpoints of either
load into the other. Where DeepSpeed misbehaves this package does the documented right thing; see
:class:`MoE`.

Names are resolved on first access so ``import deepnvme.moe`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it; each MoE part adds its own lines here.
_WHERE = {
    "MoE": "layer",
    "MOELayer": "sharded_moe",
    "TopKGate": "gating",
    "Routes": "gating",
    "top1gating": "gating",
    "top2gating": "gating",
    "topkgating": "gating",
    "Experts": "experts",
    "has_moe_layers": "utils",
    "is_moe_param": "utils",
    "split_params_into_shared_and_expert_params": "utils",
    "split_params_grads_into_shared_and_expert_params": "utils",
    "split_params_into_different_moe_groups_for_optimizer": "utils",
    "is_moe_param_group": "utils",
    "configure_moe_param_groups": "utils",
    "create_expert_and_data_parallel_groups": "groups",
    "get_expert_parallel_group": "groups",
    "get_expert_data_parallel_group": "groups",
    "expert_group_name": "groups",
    "allreduce_moe_gradients": "grads",
    "broadcast_moe_parameters": "broadcast",
    "assign_slots": "routing",
    "dispatch": "routing",
    "combine": "routing",
    "top_k": "routing",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining submodule on first use of a public name."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'deepnvme.moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f"deepnvme.moe.{module}"), name)


def __dir__() -> list[str]:
    """Show the lazy names too."""
    return sorted(set(globals()) | set(_WHERE))
