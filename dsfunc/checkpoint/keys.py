"""What a state holds, under keys and global shapes that do not depend on the world size.

**Resharding.** Each unit's fp32 master weights are stored as one flat vector of its *unpadded* length, a
DTensor sharded on dim 0 exactly as ``torch.chunk`` splits it (each rank writes its own slice; at stage 0
each rank writes its ``torch.chunk`` slice of its full copy); every optimizer-state leaf shaped like a unit
the same way; and everything else (step, optimizer counters, loss scaler, dropout seed, metrics, buffers)
once, from rank 0. A load reads the slices it needs, so any world size and ZeRO stage loads any checkpoint,
and the fp32 masters make fp16/bf16/fp32 runs interchangeable (the loss-scaler state is kept only when the
precision and the kind of scaler are unchanged: :func:`dsfunc.checkpoint.compat.wanted`).

A tensor-parallel state stores its unit-shaped tensors per parameter instead (:mod:`.per_param`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Shard

from dsfunc.checkpoint.coordination import mesh
from dsfunc.checkpoint.per_param import load_parts, save_parts, uses_per_param
from dsfunc.optim.transforms import ScheduleState
from dsfunc.state import TrainState
from dsfunc.zero.layout import chunk_range


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a state: its key, this rank's tensor, the unit it is laid out like (or None), and which
    part of the state it belongs to: ``step``, ``rng``, ``params``, ``optimizer``, ``schedule`` (the lr
    schedule's position inside the optimizer state), ``scaler``, ``metrics`` or ``buffers``."""

    key: str
    tensor: torch.Tensor
    unit: str | None
    part: str


def entries(state: TrainState, *, exclude_frozen: bool = False) -> list[Entry]:
    """Every tensor of ``state`` under a world-size-independent key (the same on every rank); with
    ``exclude_frozen``, none of the frozen parameters (kept with the buffers)."""
    params = state.params
    out = [Entry("step", state.step, None, "step"), Entry("rng", state.rng, None, "rng")]
    out += [Entry(f"params/{name}", t, name, "params") for name, t in params.items()]
    for key, accessor, leaf in _leaves("optim", state.opt_state):
        last = accessor[-1] if len(accessor) else None
        unit = last.entry if isinstance(last, optree.MappingEntry) else None
        shaped = unit in params and leaf.shape == params[unit].shape
        part = "schedule" if any(e.type is ScheduleState for e in accessor) else "optimizer"
        out.append(Entry(key, leaf, unit if shaped else None, part))
    out += [Entry(key, leaf, None, "scaler") for key, _, leaf in _leaves("scaler", state.scaler)]
    out += [Entry(key, leaf, None, "metrics") for key, _, leaf in _leaves("metrics", state.metrics)]
    frozen = set(state.program.plan.frozen) if exclude_frozen else set()
    out += [Entry(f"buffers/{name}", t, None, "buffers") for name, t in state.buffers.items() if name not in frozen]
    return out


def _leaves(prefix: str, tree: Any) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """``(key, accessor, leaf)``, keys like ``optim/optimizer/adam/mu/root`` (field names, not indices)."""
    named = (optree.NamedTupleEntry, optree.DataclassEntry)
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree)
    for accessor, leaf in zip(accessors, leaves):
        names = [str(e.field) if isinstance(e, named) else str(e.entry) for e in accessor]
        yield "/".join([prefix, *names]), accessor, leaf


def save_dict(state: TrainState, *, staged: bool, exclude_frozen: bool = False) -> dict[str, Any]:
    """What this rank hands to DCP: its slice of every unit-shaped tensor, and (rank 0) the rest (without the
    frozen parameters, with ``exclude_frozen``).

    ``staged`` copies everything to host memory so training may go on while a thread writes it. GPU
    tensors always go through host memory: DCP then coordinates on the gloo side group with CPU
    tensors only.
    """
    plan = state.program.plan
    world, rank = plan.world_size, plan.rank
    copy = (lambda t: t.detach().to("cpu", copy=True)) if staged else (lambda t: t.detach().cpu())
    per_param = uses_per_param(state)
    out: dict[str, Any] = {}
    for e in entries(state, exclude_frozen=exclude_frozen):
        if e.unit is None:
            if rank == 0:
                out[e.key] = copy(e.tensor)
            continue
        if per_param:
            out.update(save_parts(state, e.key, plan.unit(e.unit), e.tensor, copy))
            continue
        numel = plan.unit(e.unit).numel
        if world == 1:
            out[e.key] = copy(e.tensor[:numel])
            continue
        start, stop = chunk_range(numel, world, rank)
        local = e.tensor[: stop - start] if plan.ways > 1 else e.tensor[start:stop]
        local = copy(local)
        out[e.key] = DTensor.from_local(local, mesh(local.device.type, plan.group), [Shard(0)], shape=(numel,),
                                        stride=(1,), run_check=False)
    return out


def load_dict(
    state: TrainState, wanted: set[str], *, per_param: bool
) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """DCP targets that are views of the template's own CPU tensors, so the load fills them in place;
    GPU tensors get a host buffer, returned as ``(device view, host buffer)`` pairs to copy back.
    ``per_param``: the checkpoint stores unit-shaped tensors per parameter (:mod:`.per_param`)."""
    plan = state.program.plan
    out: dict[str, Any] = {}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_host(view: torch.Tensor) -> torch.Tensor:
        if view.device.type == "cpu":
            return view
        host = torch.empty_like(view, device="cpu")
        copy_back.append((view, host))
        return host

    for e in entries(state):
        if e.key not in wanted:
            continue
        if e.unit is not None and per_param:
            out.update(load_parts(state, e.key, plan.unit(e.unit), e.tensor, copy_back))
            continue
        if e.unit is None or plan.ways == 1:
            out[e.key] = on_host(e.tensor)
            continue
        unit = plan.unit(e.unit)
        start, stop = plan.local_range(unit)
        e.tensor[stop - start:].zero_()  # the padding tail stays zero
        out[e.key] = DTensor.from_local(on_host(e.tensor[: stop - start]), mesh("cpu", plan.group), [Shard(0)],
                                        shape=(unit.numel,), stride=(1,), run_check=False)
    return out, copy_back
