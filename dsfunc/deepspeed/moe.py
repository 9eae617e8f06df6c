"""``deepspeed.moe.utils``: the helpers scripts call on every model, MoE or not. dsfunc has no MoE layers
(``deepspeed.moe.layer.MoE`` raises when built), so no parameter is an expert's."""

from __future__ import annotations

from typing import Any

from dsfunc.errors import unsupported


def is_moe_param(param: Any) -> bool:
    """Whether ``param`` belongs to an expert: never, in dsfunc."""
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = None) -> list[Any]:
    """DeepSpeed puts expert parameters in param groups of their own; without experts the groups are the
    given ones (a dict or a tuple of them becomes a list, as DeepSpeed returns)."""
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups)


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    return unsupported(f"deepspeed.moe.{name}", "mixture of experts")
