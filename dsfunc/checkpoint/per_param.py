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

A state with MoE experts is saved the same way, each expert under its place in the whole model
(:mod:`dsfunc.experts.placement`), so a load at another expert-parallel degree reads the experts it holds. A
parameter is a tp slice or an ep slice, never both (AutoEP's experts stay whole over tp: ``init_state`` refuses a tp
plan that splits them). Everything is read by parameter name, so the loading state may group its parameters into
other units (a tp x ep AutoEP checkpoint loads into the plain Hugging Face model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from dsfunc.checkpoint.coordination import mesh
from dsfunc.distributed import comm
from dsfunc.experts.placement import expert_split
from dsfunc.state import TrainState
from dsfunc.zero.layout import ParamSlot, Unit, unit_views

LAYOUT = "params"  # the metadata's ``layout`` of such a checkpoint; ``"units"`` (or none) is the flat one


@dataclasses.dataclass(frozen=True)
class Part:
    """One of this rank's parameters in the whole model: its name and shape there and, when this rank's tensor is a
    slice of it, the slice's placements over ``group`` (and the whole tensor's stride)."""

    name: str
    shape: tuple[int, ...]
    placements: tuple[Any, ...] | None = None
    group: comm.Group | None = None
    stride: tuple[int, ...] | None = None


def uses_per_param(state: TrainState) -> bool:
    """Whether ``state`` saves in the per-parameter layout (it is tensor parallel or has MoE experts)."""
    program = state.program
    return program.tensor is not None or any(expert_split(program.skeleton, u) for u in program.plan.units)


def param_key(unit_key: str, name: str) -> str:
    """The key of parameter ``name``'s part of the unit-shaped tensor stored under ``unit_key``
    (``params/<unit>``)."""
    return f"{unit_key.rsplit('/', 1)[0]}/{name}"


def part(state: TrainState, unit: Unit, slot: ParamSlot) -> Part:
    """Where ``slot`` of ``unit`` sits in the whole model: split over tp, an expert of another global index
    (:mod:`dsfunc.experts.placement`), a rank's slice of stacked experts, or itself."""
    tensor = state.program.tensor
    spec = tensor.split.get(slot.name) if tensor is not None else None
    if spec is not None:
        return Part(slot.name, tuple(spec.shape), tuple(spec.placements), tensor.group, tuple(spec.stride))
    split = expert_split(state.program.skeleton, unit)
    if split is None or split.ep.size == 1:
        return Part(slot.name, tuple(slot.shape))
    if not split.stacked:
        return Part(split.name(unit, slot.name, split.ep.rank), tuple(slot.shape))
    shape = (slot.shape[0] * split.ep.size, *slot.shape[1:])
    return Part(slot.name, shape, (Shard(0),), split.ep, torch.empty(shape, device="meta").stride())


def whole_params(state: TrainState, unit: Unit) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """``(name, shape, aliases)`` of each of ``unit``'s parameters in the whole model, in layout order: an expert
    unit's of every expert-parallel rank."""
    split = expert_split(state.program.skeleton, unit)
    if split is None or split.stacked or split.ep.size == 1:
        return [(p.name, p.shape, slot.aliases if p.name == slot.name else (p.name,))
                for slot in unit.params for p in [part(state, unit, slot)]]
    return [(split.name(unit, slot.name, r), tuple(slot.shape), tuple(split.name(unit, a, r) for a in slot.aliases))
            for r in range(split.ep.size) for slot in unit.params]


def save_parts(state: TrainState, key: str, unit: Unit, local: torch.Tensor,
               copy: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """``{param key: this rank's part}`` of the unit-shaped tensor ``local`` (this rank's ZeRO shard): a
    collective over the unit's ZeRO ranks, then a DTensor for each parameter that is a slice of the model's."""
    plan = state.program.plan
    flat = torch.empty(plan.padded_size(unit), dtype=local.dtype, device=local.device)
    if plan.ways_of(unit) > 1:
        comm.all_gather_flat(flat, local, plan.group_of(unit))
    else:
        flat.copy_(local[: flat.numel()])
    out: dict[str, Any] = {}
    for slot, view in zip(unit.params, unit_views(unit, flat)):
        piece, where = copy(view), part(state, unit, slot)
        out[param_key(key, where.name)] = piece if where.placements is None else DTensor.from_local(
            piece, mesh(piece.device.type, where.group), where.placements, shape=where.shape, stride=where.stride,
            run_check=False)
    return out


def load_parts(state: TrainState, key: str, unit: Unit, local: torch.Tensor,
               copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """DCP targets for every parameter of ``unit`` in a host flat buffer of the template's layout; its ZeRO range
    is queued in ``copy_back`` for ``local`` (the template's shard, whose padding tail is zeroed)."""
    plan = state.program.plan
    start, stop = plan.local_range(unit)
    flat = torch.zeros(unit.numel, dtype=local.dtype)
    local[stop - start:].zero_()
    copy_back.append((local[: stop - start], flat[start:stop]))
    out: dict[str, Any] = {}
    for slot, view in zip(unit.params, unit_views(unit, flat)):
        where = part(state, unit, slot)
        out[param_key(key, where.name)] = view if where.placements is None else DTensor.from_local(
            view, mesh("cpu", where.group), where.placements, shape=where.shape, stride=where.stride,
            run_check=False)
    return out
