"""Module hooks on the skeleton: stage-3 units gather around their forward, and inputs take the compute dtype.

The hooks are installed once, on the skeleton. While a micro-batch runtime is bound
(:attr:`~dsfunc.zero.gather.Workspace.active`) a unit's hooks bind it for the runtime; outside a step
(a module trained in place, called by the script) they expose the gathered unit in the module's own
parameters for the unit's forward, as DeepSpeed's ZeRO-3 module hooks do.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dsfunc.zero.gather import Workspace
from dsfunc.zero.layout import Unit


def install_unit_hooks(skeleton: nn.Module, workspace: Workspace) -> list[RemovableHandle]:
    """On each lazily gathered unit's module: gather and bind before its forward, free after it."""
    handles = []
    for unit in workspace.plan.units:
        if not workspace.lazy(unit):
            continue
        module = skeleton.get_submodule(unit.module)
        exposed: list[bool] = []  # per call in flight: whether pre exposed the unit (post then hides it)

        def pre(mod: nn.Module, args: Any, u: Unit = unit, exposed: list[bool] = exposed) -> None:
            exposed.append(workspace.active is None)
            if exposed[-1]:
                workspace.expose(u)
            else:
                workspace.active.unit_forward_begins(u)

        def post(mod: nn.Module, args: Any, output: Any, u: Unit = unit, exposed: list[bool] = exposed) -> None:
            if exposed.pop():
                workspace.hide(u)
            elif workspace.active is not None:
                workspace.active.unit_forward_ends(u, output)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return handles


def install_input_cast(skeleton: nn.Module, workspace: Workspace, dtype: torch.dtype) -> list[RemovableHandle]:
    """Cast floating-point inputs of the model's forward to the compute dtype (as FSDP2 does)."""
    if dtype == torch.float32:
        return []

    def cast(module: nn.Module, args: Any, kwargs: Any) -> Any:
        if workspace.active is None:
            return None
        f = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        return optree.tree_map(f, args), optree.tree_map(f, kwargs)

    return [skeleton.register_forward_pre_hook(cast, with_kwargs=True)]
