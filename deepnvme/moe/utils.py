"""Parameter helpers: tell expert parameters apart and build the optimiser groups DeepSpeed builds.

An expert parameter is one tagged ``allreduce = False`` (with ``group_name = "ep_size_{ep}"``) by
:class:`deepnvme.moe.Experts`, exactly DeepSpeed's definition, so these helpers also work on DeepSpeed models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# DeepSpeed's default chunk (in elements) for MoE optimiser groups, from its ZeRO-2 fp32 up-casting memory
# limit.
DEFAULT_MAX_GROUP_SIZE = 178956971


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(True, num_experts of the first MoE layer) if ``m`` contains a an MoE layer, else (False, 0)."""
    from deepnvme.moe.layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """True for expert parameters (tagged ``allreduce = False``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(shared, expert) parameters, each in the given order."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(shared grads, expert grads) cast to their parameter's dtype; parameters without a grad are skipped."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | list[dict[str, Any]] | tuple[dict[str, Any], ...],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Move expert parameters out of each group into groups of their own, as DeepSpeed does.

    For every original group and every expert ``group_name`` it adds a copy of the group's hyper-parameters
    with ``name = group_name`` and ``moe = True`` holding those expert parameters; the original group keeps
    the rest. With ``max_group_size`` (elements), an MoE group is cut greedily into several groups of at most
    that size. Differences from DeepSpeed: a group without a ``'name'`` key works (DeepSpeed raises KeyError),
    and no empty group is emitted when a single parameter exceeds ``max_group_size``.
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(
            f"param_groups must be a dict, list or tuple of dicts, got {type(param_groups).__name__}"
        )
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"param_groups[{i}] must be a dict with a 'params' entry")
        g["params"] = list(g["params"])

    moe_groups: list[dict[str, Any]] = []
    for g in groups:
        by_name: dict[str, list[nn.Parameter]] = {}
        for p in g["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        g["params"] = [p for p in g["params"] if not is_moe_param(p)]
        for name, params in by_name.items():
            for chunk in _chunks(params, max_group_size):
                moe_groups.append({**g, "name": name, "moe": True, "params": chunk})
    return groups + moe_groups


def _chunks(params: list[nn.Parameter], limit: int | float | None) -> list[list[nn.Parameter]]:
    """Greedy runs of parameters with total numel within ``limit`` (a larger parameter gets its own run)."""
    if limit is None:
        return [params]
    runs: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        n = int(getattr(p, "ds_numel", p.numel()))
        if runs and size + n <= limit:
            runs[-1].append(p)
            size += n
        else:
            runs.append([p])
            size = n
    return runs


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """True for a group made by :func:`split_params_into_different_moe_groups_for_optimizer`."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Optimiser groups for a model with MoE layers, as DeepSpeed's engine makes them without a client
    optimiser.

    A list of parameters becomes one group named ``dense-params`` plus the MoE groups; a list of group dicts
    without any ``'moe'`` key is split; a list that already has MoE groups is returned unchanged.
    """
    if not isinstance(model_parameters, list) or not model_parameters:
        raise ValueError("model_parameters must be a non-empty list of tensors or of param-group dicts")
    if not all(isinstance(p, (torch.Tensor, dict)) for p in model_parameters):
        raise TypeError("model_parameters must hold tensors or param-group dicts only")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
