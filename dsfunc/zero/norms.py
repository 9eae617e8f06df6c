"""Norms over sharded gradients and parameters: one collective for the global norm, Lamb's per-parameter norms.

At stages 1-3 each rank holds a shard of every unit, so a norm is a sum of squares per rank and one
all-reduce. The step's loss rides along in that all-reduce (the mean loss over ranks). With tensor
parallelism a rank holds its tp part of the split parameters: their squares are summed over tp too, while
the replicated parameters (the same on every tp rank) are counted once.
At stage 0 every rank holds all of a unit, but a unit replicated over a group of its own only (an expert,
:mod:`dsfunc.experts`) differs between groups: its squares are summed over the plan's ranks, each divided by its
group's size. At stages 1-3 such a unit is sharded over its group, and the groups of the plan's ranks hold each
distinct expert once between them: its shards' squares are summed over the plan's ranks like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from dsfunc import kernels
from dsfunc.distributed import comm
from dsfunc.errors import NotSupportedError
from dsfunc.zero.layout import ShardingPlan, Unit


def global_norm_and_loss(plan: ShardingPlan, grads: Mapping[str, torch.Tensor], loss: torch.Tensor, *,
                         sumsq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of squares of every rank's ``grads`` (inf/nan anywhere make it non-finite, on every rank
    alike) and the mean of ``loss`` over ranks, with one small all-reduce. ``sumsq``: this rank's sum of
    squares, already taken (on the device, before offloaded gradients left it): the sum of :func:`unit_sumsq`."""
    if plan.split:
        return _tensor_parallel_norm_and_loss(plan, grads, loss, sumsq)
    own = [u for u in plan.units if u.group is not None and plan.ways == 1]
    if sumsq is None:
        sumsq = kernels.sum_of_squares([g for name, g in grads.items() if not any(u.name == name for u in own)])
    elif own:
        raise NotSupportedError("a precomputed sum of squares with units reduced over groups of their own")
    if own:  # replicated over their own group only (experts): each distinct copy counted once, over the plan's ranks
        parts = torch.stack([kernels.sum_of_squares([grads[u.name]]) / u.group.size for u in own])
        comm.all_reduce_sum(parts, plan.group)
        sumsq = sumsq + parts.sum()
    if plan.world_size > 1:
        packed = torch.stack([sumsq if plan.ways > 1 else torch.zeros_like(sumsq), loss.float()])
        comm.all_reduce_sum(packed, plan.group)
        sumsq = packed[0] if plan.ways > 1 else sumsq
        loss = packed[1] / plan.world_size
    return sumsq, loss


def unit_sumsq(plan: ShardingPlan, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
    """This rank's sum of squares of ``unit``'s gradient shard ``grad``, as :func:`global_norm_and_loss` sums it:
    one number, or with tensor parallelism three (the replicated parameters', the split ones', an expert's, each
    reduced over its own ranks). ZeRO-Offload takes it on the device, before the gradient leaves for the host."""
    if not plan.split:
        return kernels.sum_of_squares([grad])
    out = grad.new_zeros(3, dtype=torch.float32)
    if unit.group is not None:
        out[2] = kernels.sum_of_squares([grad]).float() / (1 if plan.ways > 1 else unit.group.size)
        return out
    start, stop = plan.local_range(unit)
    parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for slot in unit.params:
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, stop)
        if lo < hi:
            parts[slot.name in plan.split].append(grad[lo - start : hi - start])
    for i, part in enumerate(parts):
        if part:
            out[i] = kernels.sum_of_squares(part).float()
    return out


def _tensor_parallel_norm_and_loss(plan: ShardingPlan, grads: Mapping[str, torch.Tensor], loss: torch.Tensor,
                                   sumsq: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`global_norm_and_loss` when parameters are split over tp: the split parameters' squares summed over
    ``plan.group`` and tp, the replicated ones' over ``plan.group`` only. Experts (units with a group of their own)
    differ between the ranks of a tp group too: their squares are summed over every rank, each divided by its
    group's size at stage 0 (where each of the group's ranks holds it whole)."""
    if sumsq is None:
        sumsq = torch.stack([unit_sumsq(plan, plan.unit(name), grad).to(loss.device)
                             for name, grad in grads.items()]).sum(0) if grads else loss.new_zeros(3)
    packed = torch.cat([sumsq.float().to(loss.device), loss.float().reshape(1)])
    if plan.ways > 1:
        comm.all_reduce_sum(packed, plan.group)
    elif plan.world_size > 1:  # unsharded: every rank holds the same full gradients, but experts and the loss
        comm.all_reduce_sum(packed[2:], plan.group)
    comm.all_reduce_sum(packed[1:3], plan.tp)
    return packed[:3].sum(), packed[3] / plan.world_size


def segment_norm_fn(plan: ShardingPlan, device: torch.device) -> Callable[[Any], Any]:
    """Per-parameter L2 norms over flat shards, broadcast back per element (Lamb's trust ratio): each parameter's
    squares summed over the ranks its unit is sharded over, and a tp-split parameter's over tp too (the whole
    parameter's norm; a replicated one's is already whole on each tp rank).

    The per-element segment index it needs is built on the first call, so optimizers that never ask
    (Adam, SGD, ...) pay no memory for it.
    """
    ids: dict[str, torch.Tensor] = {}
    split: dict[str, torch.Tensor] = {}  # unit -> the indices of its tp-split parameters

    def segment_ids(where: torch.device) -> dict[str, torch.Tensor]:
        for unit in plan.units:
            start, stop = plan.local_range(unit)
            seg = torch.full((plan.shard_size(unit),), len(unit.params), dtype=torch.int32)
            for i, slot in enumerate(unit.params):
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, stop)
                if lo < hi:
                    seg[lo - start : hi - start] = i
            ids[unit.name] = seg.to(where)
            split[unit.name] = torch.tensor([i for i, slot in enumerate(unit.params) if slot.name in plan.split],
                                            dtype=torch.int64, device=where)
        return ids

    def segment_norm(squares: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        host = next(iter(squares.values())).device  # the device, or the host when offloaded
        seg = ids or segment_ids(host)
        sums = {
            name: torch.zeros(len(plan.unit(name).params) + 1, dtype=torch.float32, device=sq.device)
            .index_add_(0, seg[name], sq.float())
            for name, sq in squares.items()
        }
        by_group: dict[tuple[int, ...], list[str]] = {}  # units sharded over the same ranks: one all-reduce
        for name in sums:
            unit = plan.unit(name)
            if plan.ways_of(unit) > 1:
                by_group.setdefault(plan.group_of(unit).ranks, []).append(name)
        for names in by_group.values():
            packed = torch.cat([sums[n] for n in names]).to(device)  # offloaded shards: reduce on the device (NCCL)
            comm.all_reduce_sum(packed, plan.group_of(plan.unit(names[0])))
            sums.update(zip(names, packed.to(host).split([sums[n].numel() for n in names])))
        if plan.split:  # every rank's units in the same order: one all-reduce over tp
            packed = torch.cat([sums[n][split[n]] for n in sums]).to(device)
            comm.all_reduce_sum(packed, plan.tp)
            for name, part in zip(sums, packed.to(host).split([split[n].numel() for n in sums])):
                sums[name] = sums[name].index_copy(0, split[name], part)
        return {name: s.sqrt()[seg[name]].to(squares[name].dtype) for name, s in sums.items()}

    return segment_norm
