"""The per-parameter layout of a checkpoint: how a tensor-parallel state is saved, and how any state loads it.

A tp rank's unit holds its *tp-local* parts of the parameters, so its flat buffer is no slice of the global
model's. A tp state therefore stores every unit-shaped tensor (master weights, Adam moments, momentum) per
parameter, under ``<prefix>/<parameter name>`` (``params/model.norm.weight``,
``optim/optimizer/adam/mu/model.layers.0.mlp.up_proj.weight``) with the parameter's *global* shape: a split
parameter as a DTensor over the tp ranks with its own placements (each tp rank writes its slice of the global
tensor), a replicated one as a plain tensor; DCP writes each chunk once however many dp ranks hold it.

ZeRO's shards cut a unit's flat buffer across parameters, so a save first gathers each unit over ZeRO's ranks
(``dp x sp``; the memory of one rank's tp-local model and optimizer state, for the time of the save), and a
load reads whole tp-local parameters into a flat buffer of the template's layout and keeps its own ZeRO range.
Any mesh (tp 1 or 2, dp, sp, one process) loads such a checkpoint; export reads each parameter whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dsfunc.checkpoint.coordination import mesh
from dsfunc.distributed import comm
from dsfunc.state import TrainState
from dsfunc.zero.layout import ParamSlot, Unit, unit_views

LAYOUT = "params"  # the metadata's ``layout`` of such a checkpoint; ``"units"`` (or none) is the flat one


def uses_per_param(state: TrainState) -> bool:
    """Whether ``state`` saves in the per-parameter layout (it is tensor parallel)."""
    return state.program.tensor is not None


def param_key(unit_key: str, slot: ParamSlot) -> str:
    """The key of ``slot``'s part of the unit-shaped tensor stored under ``unit_key`` (``params/<unit>``)."""
    return f"{unit_key.rsplit('/', 1)[0]}/{slot.name}"


def global_shape(state: TrainState, slot: ParamSlot) -> tuple[int, ...]:
    """``slot``'s shape in the whole model (a tp-split parameter's is not the local one)."""
    tensor = state.program.tensor
    spec = tensor.split.get(slot.name) if tensor is not None else None
    return tuple(spec.shape) if spec is not None else tuple(slot.shape)


def global_offsets(state: TrainState, unit: Unit) -> list[int]:
    """Where each of ``unit``'s parameters starts in the whole model's flat unit (packed in layout order)."""
    sizes = [math.prod(global_shape(state, s)) for s in unit.params]
    return [sum(sizes[:i]) for i in range(len(sizes))]


def save_parts(state: TrainState, key: str, unit: Unit, local: torch.Tensor,
               copy: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """``{param key: this rank's part}`` of the unit-shaped tensor ``local`` (this rank's ZeRO shard): a
    collective over ZeRO's ranks, then a DTensor over tp for each split parameter."""
    plan, tensor = state.program.plan, state.program.tensor
    flat = torch.empty(plan.padded_size(unit), dtype=local.dtype, device=local.device)
    comm.all_gather_flat(flat, local, plan.group) if plan.ways > 1 else flat.copy_(local[: flat.numel()])
    out: dict[str, Any] = {}
    for slot, view in zip(unit.params, unit_views(unit, flat)):
        part = copy(view)
        spec = tensor.split.get(slot.name) if tensor is not None else None
        out[param_key(key, slot)] = part if spec is None else DTensor.from_local(
            part, mesh(part.device.type, tensor.group), spec.placements, shape=spec.shape, stride=spec.stride,
            run_check=False)
    return out


def load_parts(state: TrainState, key: str, unit: Unit, local: torch.Tensor,
               copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """DCP targets for every parameter of ``unit`` in a host flat buffer of the template's layout; its ZeRO range
    is queued in ``copy_back`` for ``local`` (the template's shard, whose padding tail is zeroed)."""
    plan, tensor = state.program.plan, state.program.tensor
    start, stop = plan.local_range(unit)
    flat = torch.zeros(unit.numel, dtype=local.dtype)
    local[stop - start:].zero_()
    copy_back.append((local[: stop - start], flat[start:stop]))
    out: dict[str, Any] = {}
    for slot, view in zip(unit.params, unit_views(unit, flat)):
        spec = tensor.split.get(slot.name) if tensor is not None else None
        out[param_key(key, slot)] = view if spec is None else DTensor.from_local(
            view, mesh("cpu", tensor.group), spec.placements, shape=spec.shape, stride=spec.stride, run_check=False)
    return out
