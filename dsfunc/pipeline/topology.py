"""The pipeline × data-parallel grid of ranks and its process groups.

Ranks are laid out as DeepSpeed's ``PipeDataParallelTopology``: ``rank = stage * data_parallel + replica``
(the data axis varies fastest), so a stage's data-parallel ranks are neighbours. Each replica's pipeline
group orders its ranks by stage, as ``torch.distributed.pipelining`` expects (stage ``s`` on group rank
``s``). Every rank creates every group, in the same order (``new_group`` is collective).
"""

from __future__ import annotations

import dataclasses
import functools

import torch.distributed as dist

from dsfunc.distributed import comm
from dsfunc.errors import InputError


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """This rank's place in the grid and the groups it talks over."""

    stages: int  # pipeline ranks per replica (the stages, or stages / stages_per_rank for an interleaved schedule)
    data_parallel: int
    stage: int  # this rank's place in its replica's pipeline
    replica: int
    pipe_group: dist.ProcessGroup | None  # this replica's ranks, one per stage (None on one rank; one rank when
    # there is one stage: torch's PipelineStage needs a group as large as the stages)
    data_group: dist.ProcessGroup | None  # this stage's replicas (None only on one rank: the world)
    tied_groups: dict[str, comm.Group | None]  # tie key -> this replica's stages holding it (None: this one only)
    tied_holders: dict[str, list[int]]  # tie key -> the stages holding it (the keys this stage holds)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def global_rank(self, stage: int, replica: int) -> int:
        return stage * self.data_parallel + replica

    @functools.cached_property
    def data(self) -> comm.Group:
        """This stage's replicas: its ZeRO's group."""
        return comm.Group.of(self.data_group)

    @functools.cached_property
    def pipe(self) -> comm.Group:
        """This replica's ranks, one per stage."""
        return comm.Group.of(self.pipe_group)


def check_world(stages: int, world: int) -> int:
    """The data-parallel size left for ``stages`` pipeline stages on ``world`` ranks."""
    if stages < 1:
        raise InputError(f"pipeline stages must be at least 1, got {stages}")
    if world % stages:
        raise InputError(
            f"the world size {world} is not divisible by the {stages} pipeline stages: launch a multiple of "
            f"{stages} ranks (each stage gets world_size / stages data-parallel replicas) or change the stages"
        )
    return world // stages


def make_topology(stages: int, tied_stages: dict[str, list[int]]) -> Topology:
    """Build the grid for ``stages`` pipeline ranks per replica on the current world; ``tied_stages`` maps each
    tie key to the pipeline ranks holding that module (a group per replica joins them)."""
    world, rank = comm.world_size(), comm.rank()
    dp = check_world(stages, world)
    stage, replica = divmod(rank, dp)

    def group(ranks: list[int]) -> dist.ProcessGroup | None:
        if world == 1:
            return None
        made = dist.new_group(ranks=ranks)
        return made if rank in ranks else None

    pipe = data = None
    for r in range(dp):
        g = group([s * dp + r for s in range(stages)])
        pipe = g if r == replica else pipe
    for s in range(stages):
        g = group([s * dp + r for r in range(dp)])
        data = g if s == stage else data
    tied: dict[str, comm.Group | None] = {}
    holders_of: dict[str, list[int]] = {}
    for key in sorted(tied_stages):
        holders = sorted(set(tied_stages[key]))
        for r in range(dp):
            g = group([s * dp + r for s in holders]) if len(holders) > 1 else None
            if r == replica and stage in holders:
                tied[key], holders_of[key] = (None if g is None else comm.Group.of(g)), holders
    return Topology(stages, dp, stage, replica, pipe, data, tied, holders_of)
