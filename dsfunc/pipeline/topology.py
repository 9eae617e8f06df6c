"""The pipeline grid of ranks: the run's mesh (``pp x dp x tp``, :func:`dsfunc.distributed.mesh.pipeline_mesh`) and the
groups a pipeline talks over.

Ranks are laid out as DeepSpeed's ``PipeModelDataParallelTopology`` (and torchtitan's mesh): ``pp`` outermost, then
``dp``, then ``tp`` innermost, ``rank = (stage * dp + replica) * tp + tp_rank``, so a stage's ranks are neighbours.
Each (replica, tp rank)'s pipeline group orders its ranks by stage, as ``torch.distributed.pipelining`` expects
(stage ``s`` on group rank ``s``): tp rank ``t`` of a stage sends its (tp-replicated) activations to tp rank ``t`` of
the next. Every rank creates every group, in the same order (``new_group`` is collective).
"""

from __future__ import annotations

import dataclasses
import functools

import torch.distributed as dist

from dsfunc.distributed import comm
from dsfunc.distributed.mesh import Mesh, make_mesh
from dsfunc.errors import InputError


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """This rank's place in the grid and the groups it talks over."""

    mesh: Mesh  # pp x dp x tp
    stages: int  # pipeline ranks per replica (the stages, or stages / stages_per_rank for an interleaved schedule)
    data_parallel: int
    stage: int  # this rank's place in its replica's pipeline
    replica: int
    pipe_group: dist.ProcessGroup | None  # this (replica, tp rank)'s ranks, one per stage (None on one rank; one
    # rank when there is one stage: torch's PipelineStage needs a group as large as the stages)
    data_group: dist.ProcessGroup | None  # this stage's replicas at this tp rank (None on one rank)
    tied_groups: dict[str, comm.Group | None]  # tie key -> this pipeline's stages holding it (None: this one only)
    tied_holders: dict[str, list[int]]  # tie key -> the stages holding it (the keys this stage holds)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    @functools.cached_property
    def data(self) -> comm.Group:
        """This stage's replicas: its ZeRO's group."""
        return self.mesh.group("dp")

    @functools.cached_property
    def pipe(self) -> comm.Group:
        """This pipeline's ranks, one per stage."""
        return comm.Group.of(self.pipe_group)


def check_world(stages: int, world: int) -> int:
    """The ranks per stage left for ``stages`` pipeline stages on ``world`` ranks."""
    if stages < 1:
        raise InputError(f"pipeline stages must be at least 1, got {stages}")
    if world % stages:
        raise InputError(
            f"the world size {world} is not divisible by the {stages} pipeline stages: launch a multiple of "
            f"{stages} ranks (each stage gets world_size / stages data-parallel replicas) or change the stages"
        )
    return world // stages


def make_topology(stages: int, tied_stages: dict[str, list[int]], mesh: Mesh | None = None) -> Topology:
    """The grid for ``stages`` pipeline ranks per replica on ``mesh`` (default: ``pp x dp`` over the current world);
    ``tied_stages`` maps each tie key to the pipeline ranks holding that module (a group per pipeline joins them)."""
    check_world(stages, comm.world_size())
    mesh = mesh if mesh is not None else make_mesh(pp=stages)
    if mesh.size("pp") != stages:
        raise InputError(f"a mesh with pp {mesh.size('pp')} cannot hold {stages} pipeline ranks per replica")
    world, rank = comm.world_size(), comm.rank()
    pipe = mesh.group("pp")
    if stages == 1 and world > 1:  # torch's PipelineStage needs a group of one: every rank makes each rank's
        for r in range(world):
            made = dist.new_group(ranks=[r])
            pipe = comm.Group.of(made) if r == rank else pipe
    lanes = world // stages  # the pipelines: one per (replica, tp rank), lane l's stage s on global rank s * lanes + l
    lane = rank % lanes
    if stages > 1 and pipe.ranks != tuple(s * lanes + lane for s in range(stages)):
        raise InputError(f"the mesh's pp axis joins ranks {list(pipe.ranks)}: a pipeline's mesh has pp outermost "
                         '(its first dimension, e.g. mesh_dim_names=("pp", "dp", "tp")), each stage\'s ranks neighbours')
    tied: dict[str, comm.Group | None] = {}
    holders_of: dict[str, list[int]] = {}
    for key in sorted(tied_stages):
        holders = sorted(set(tied_stages[key]))
        for r in range(lanes):
            made = dist.new_group(ranks=[s * lanes + r for s in holders]) if len(holders) > 1 else None
            if r == lane and pipe.rank in holders:
                tied[key], holders_of[key] = (None if made is None else comm.Group.of(made)), holders
    dp = mesh.group("dp")
    return Topology(mesh, stages, dp.size, pipe.rank, dp.rank, pipe.process_group if world > 1 else None,
                    dp.process_group, tied, holders_of)
