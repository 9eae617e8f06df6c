"""The whole matrices of a unit's flat shards, for updates that need them (Muon's Newton-Schulz): where each
parameter lies in the unit's flat buffer, and one all-gather of a shard-shaped tensor into the whole buffer.
See [Note: whole matrices under ZeRO] in :mod:`dsfunc.optim.muon`."""

from __future__ import annotations

import torch

from dsfunc.distributed import comm
from dsfunc.optim.muon import MatrixShards
from dsfunc.zero.layout import ShardingPlan, Unit


def matrix_shards(plan: ShardingPlan, device: torch.device) -> dict[str, MatrixShards]:
    """Every unit's :class:`~dsfunc.optim.muon.MatrixShards`; a gather runs on ``device`` (an offloaded shard
    goes there and back) and every rank of the plan must make it, unit by unit in the same order."""
    return {unit.name: _unit_matrices(plan, unit, device) for unit in plan.units}


def _unit_matrices(plan: ShardingPlan, unit: Unit, device: torch.device) -> MatrixShards:
    padded = plan.padded_size(unit)

    def gather(shard: torch.Tensor) -> torch.Tensor:
        if plan.ways == 1:
            return shard
        flat = torch.empty(padded, dtype=shard.dtype, device=device)
        comm.all_gather_flat(flat, shard.to(device), plan.group_of(unit))
        return flat

    return MatrixShards(
        shapes=tuple(unit.shapes),
        offsets=tuple(s.offset for s in unit.params),
        local=plan.local_range(unit),
        gather=gather,
    )
