"""DeepSpeed's ``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` and the topology
names, as a shell over :mod:`dsfunc.pipeline`.

``PipelineModule(layers, num_stages, loss_fn=...)`` is this rank's :class:`~dsfunc.pipeline.StageModule`,
split as DeepSpeed splits it (same partition methods, same layer build order, same state-dict names), with
the stage grid made at construction as DeepSpeed does; ``deepspeed.initialize`` then returns a
:class:`~dsfunc.deepspeed.pipe_engine.PipelineEngine` whose ``train_batch`` is ``dsfunc.train_step`` of the
pipelined state. ZeRO 2 and 3 compose with it (DeepSpeed refuses them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dsfunc.distributed import comm
from dsfunc.errors import InputError, NotSupportedError, unsupported
from dsfunc.pipeline.stage import LayerSpec, StageModule, TiedLayerSpec
from dsfunc.pipeline.topology import Topology, check_world, make_topology


class PipelineError(InputError):
    """DeepSpeed's error for a misused PipelineModule."""


class PipeDataParallelTopology:
    """DeepSpeed's pipe x data grid description: ``num_pp`` stages of ``num_dp`` replicas each."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        self.num_pp, self.num_dp = num_pp, num_dp

    def get_dim(self, axis: str) -> int:
        dims = {"pipe": self.num_pp, "data": self.num_dp}
        if axis not in dims:
            raise NotSupportedError(f"the {axis!r} axis (tensor/model parallelism) is not supported by dsfunc")
        return dims[axis]

    def world_size(self) -> int:
        return self.num_pp * self.num_dp


ProcessTopology = PipeDataParallelTopology
PipeModelDataParallelTopology = unsupported("deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology",
                                            "tensor (model) parallelism")


class PipelineModule(StageModule):
    """DeepSpeed's ``PipelineModule``: this rank's stage of ``layers`` (see the module docstring).

    ``activation_checkpoint_interval`` recomputes runs of that many layers with ``torch.utils.checkpoint``
    (non-reentrant); ``activation_checkpoint_func``, ``checkpointable_layers`` and ``dynamic_shape`` are
    accepted and not read (torch's schedule infers the shapes once, from the first step).
    """

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Any = None, checkpointable_layers: list[str] | None = None,
                 dynamic_shape: bool = False) -> None:
        if num_stages is None and topology is None:
            raise PipelineError("PipelineModule needs num_stages= (or topology=)")
        stages = topology.get_dim("pipe") if topology is not None else num_stages
        dp = check_world(stages, comm.world_size())
        if topology is not None and topology.get_dim("data") != dp:
            raise PipelineError(f"the topology has {topology.get_dim('data')} data-parallel replicas but "
                                f"{comm.world_size()} ranks over {stages} stages give {dp}")
        super().__init__(list(layers), stages=stages, stage=comm.rank() // dp, partition_method=partition_method,
                         loss_fn=loss_fn, activation_checkpoint_interval=activation_checkpoint_interval,
                         seed_layers=seed_layers, base_seed=base_seed, seed_fn=seed_fn)
        self.pipe_topology: Topology = make_topology(stages, self.tied_ranks)
        self._topo = PipeDataParallelTopology(stages, dp)

    def topology(self) -> PipeDataParallelTopology:
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise PipelineError(f"layer {layer_idx} is outside the {self.parts[-1]} layers")

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise PipelineError(f"the activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval


__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineError",
           "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
