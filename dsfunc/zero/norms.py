"""Norms over sharded gradients and parameters: one collective for the global norm, Lamb's per-parameter norms.

At stages 1-3 each rank holds a shard of every unit, so a norm is a sum of squares per rank and one
all-reduce. The step's loss rides along in that all-reduce (the mean loss over ranks). At stage 0 every rank
holds all of a unit, but a unit replicated over a group of its own only (an expert, :mod:`dsfunc.experts`)
differs between groups: its squares are summed over the world, each divided by its group's size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dsfunc import kernels
from dsfunc.distributed import comm
from dsfunc.errors import NotSupportedError
from dsfunc.zero.layout import ShardingPlan


def global_norm_and_loss(plan: ShardingPlan, grads: Mapping[str, torch.Tensor], loss: torch.Tensor, *,
                         sumsq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of squares of every rank's ``grads`` (inf/nan anywhere make it non-finite, on every rank
    alike) and the mean of ``loss`` over ranks, with one small all-reduce. ``sumsq``: this rank's sum of
    squares, already taken (on the device, before offloaded gradients left it)."""
    own = [u for u in plan.units if u.group is not None and plan.ways == 1]
    if sumsq is None:
        sumsq = kernels.sum_of_squares([g for name, g in grads.items() if not any(u.name == name for u in own)])
    elif own:
        raise NotSupportedError("a precomputed sum of squares with units reduced over groups of their own")
    if own:  # replicated over their own group only (experts): each distinct copy counted once, over the world
        parts = torch.stack([kernels.sum_of_squares([grads[u.name]]) / dist.get_world_size(u.group) for u in own])
        comm.all_reduce_sum(parts)
        sumsq = sumsq + parts.sum()
    if plan.world_size > 1:
        packed = torch.stack([sumsq if plan.ways > 1 else torch.zeros_like(sumsq), loss.float()])
        comm.all_reduce_sum(packed)
        sumsq = packed[0] if plan.ways > 1 else sumsq
        loss = packed[1] / plan.world_size
    return sumsq, loss


def segment_norm_fn(plan: ShardingPlan, device: torch.device) -> Callable[[Any], Any]:
    """Per-parameter L2 norms over flat shards, broadcast back per element (Lamb's trust ratio).

    The per-element segment index it needs is built on the first call, so optimizers that never ask
    (Adam, SGD, ...) pay no memory for it.
    """
    ids: dict[str, torch.Tensor] = {}

    def segment_ids(where: torch.device) -> dict[str, torch.Tensor]:
        for unit in plan.units:
            start, stop = plan.local_range(unit)
            seg = torch.full((plan.shard_size(unit),), len(unit.params), dtype=torch.int32)
            for i, slot in enumerate(unit.params):
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, stop)
                if lo < hi:
                    seg[lo - start : hi - start] = i
            ids[unit.name] = seg.to(where)
        return ids

    def segment_norm(squares: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        host = next(iter(squares.values())).device  # the device, or the host when offloaded
        seg = ids or segment_ids(host)
        sums = {
            name: torch.zeros(len(plan.unit(name).params) + 1, dtype=torch.float32, device=sq.device)
            .index_add_(0, seg[name], sq.float())
            for name, sq in squares.items()
        }
        if plan.ways > 1:
            packed = torch.cat(list(sums.values())).to(device)  # offloaded shards: reduce on the device (NCCL)
            comm.all_reduce_sum(packed)
            sums = dict(zip(sums, packed.to(host).split([s.numel() for s in sums.values()])))
        return {name: s.sqrt()[seg[name]].to(squares[name].dtype) for name, s in sums.items()}

    return segment_norm
