"""``deepspeed.moe.utils``: which parameters are experts' (DeepSpeed marks them ``allreduce = False`` and names
their group ``ep_size_<P>``, :class:`dsfunc.experts.Experts`) and DeepSpeed's helpers that give them optimizer
param groups of their own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsfunc.errors import InputError, InputTypeError
from dsfunc.experts.layer import MoE

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's: elements per expert param group


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """Whether ``m`` holds an MoE layer, and the first one's number of experts (0 without)."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert (is not reduced over all data-parallel ranks)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[nn.Parameter],
                                                                                    list[nn.Parameter]]:
    """``(non-expert parameters, expert parameters)``, each in the given order."""
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list[torch.Tensor],
                                                                                        list[torch.Tensor]]:
    """The gradients of ``group``'s parameters that have one, in their dtype: ``(non-expert, expert)``."""
    shared, expert = split_params_into_shared_and_expert_params([p for p in group if p.grad is not None])
    return [p.grad.to(p.dtype) for p in shared], [p.grad.to(p.dtype) for p in expert]


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: float | None = DEFAULT_MAX_GROUP_SIZE
                                                         ) -> list[dict[str, Any]]:
    """DeepSpeed's split: each group loses its expert parameters to new groups (after all the given ones), one
    per (group, expert group name) and at most ``max_group_size`` elements each, with the group's options,
    ``'name'`` the expert group's and ``'moe': True``. Given groups are changed in place, as DeepSpeed's are."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise InputTypeError(f"param groups must be a dict, or a list or tuple of dicts, not {type(param_groups)}")
    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    unnamed = [i for i, g in enumerate(param_groups) if "name" not in g]
    if names and unnamed:
        raise InputError(f"param groups {unnamed} have no 'name': DeepSpeed's MoE split keys groups by name; give "
                         "each a unique one ({'params': ..., 'name': 'dense'})")
    expert_groups: list[dict[str, Any]] = []
    for group in param_groups:
        mine = {name: {**group, "name": name, "moe": True, "params": []} for name in names}
        kept = []
        for p in group["params"]:
            (mine[p.group_name]["params"] if is_moe_param(p) else kept).append(p)
        group["params"] = kept
        expert_groups.extend(mine.values())
    for group in expert_groups:
        if max_group_size is None:
            param_groups.append(group)
            continue
        for chunk in _chunks(group["params"], max_group_size):
            param_groups.append({**group, "params": chunk})
    return param_groups


def _chunks(params: list[nn.Parameter], limit: float) -> list[list[nn.Parameter]]:
    """``params`` in runs of at most ``limit`` elements (a larger parameter alone), as DeepSpeed cuts them."""
    runs: list[list[nn.Parameter]] = []
    run: list[nn.Parameter] = []
    size = 0
    for p in params:
        numel = getattr(p, "ds_numel", p.numel())
        if size + numel <= limit:
            run.append(p)
            size += numel
        else:
            runs.append(run)
            run, size = [p], numel
    if run:
        runs.append(run)
    return runs


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether a param group holds expert parameters (DeepSpeed's ``'moe'`` key)."""
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """``model_parameters`` (parameters or param-group dicts) with the experts' in groups of their own, unless
    the dicts mark MoE groups already."""
    if not isinstance(model_parameters, list):
        raise InputTypeError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, torch.Tensor | dict):
            raise InputTypeError("param argument that would be given to the optimizer should be an iterable of "
                                 f"Tensors or dicts, but got {type(p)}")
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
