"""Module hooks on the skeleton: stage-3 units gather around their forward (and every unit's inputs are cut from
the graph for the backward by units: :mod:`dsfunc.zero.backward_by_units`), and inputs take the compute dtype.

The hooks are installed once, on the skeleton. While a micro-batch runtime is bound
(:attr:`~dsfunc.zero.gather.Workspace.active`) a unit's hooks bind it for the runtime; outside a step
(a module trained in place, called by the script) they expose the gathered unit in the module's own
parameters for the unit's forward, as DeepSpeed's ZeRO-3 module hooks do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import optree
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dsfunc.zero.gather import Workspace
from dsfunc.zero.layout import Unit


def install_unit_hooks(skeleton: nn.Module, workspace: Workspace, *, every: bool = False) -> list[RemovableHandle]:
    """On each lazily gathered unit's module (``every``: on every unit's module, for the backward by units): the
    runtime's hooks around its forward (:meth:`~dsfunc.zero.runtime.MicroBatchRuntime.unit_forward_begins`)."""
    handles = []
    for unit in workspace.plan.units:
        lazy = workspace.lazy(unit)
        if unit.module is None or not (lazy or every):
            continue
        module = skeleton.get_submodule(unit.module)
        exposed: list[bool] = []  # per call in flight: whether pre exposed the unit (post then hides it)

        def pre(mod: nn.Module, args: Any, kwargs: Any, u: Unit = unit, exposed: list[bool] = exposed,
                lazy: bool = lazy) -> tuple[Any, Any] | None:
            active = workspace.active
            exposed.append(active is None and lazy)
            if exposed[-1]:
                workspace.expose(u)
            return None if active is None else active.unit_forward_begins(u, args, kwargs)

        def post(mod: nn.Module, args: Any, output: Any, u: Unit = unit, exposed: list[bool] = exposed) -> None:
            if exposed.pop():
                workspace.hide(u)
            elif workspace.active is not None:
                workspace.active.unit_forward_ends(u, output)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
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


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output: inside tuples, lists and mappings of any class (a Hugging Face
    ``ModelOutput`` is an ``OrderedDict`` subclass that optree would take for a leaf)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from tensors_in(value)
