"""The schedules a pipelined step runs: ``torch.distributed.pipelining``'s, by their DeepSpeed-style names.

With one stage per rank: ``"1F1B"`` (one forward, one backward, as DeepSpeed's ``TrainSchedule``; the default)
and ``"GPipe"`` (every forward, then every backward); with several (``stages_per_rank``): ``"Interleaved1F1B"``,
each of the rank's stages a ``PipelineStage`` of its own.
Gradient scaling is dsfunc's (the loss carries the micro-batch and replica means), so torch's
``scale_grads`` is off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsfunc.errors import InputError
from dsfunc.pipeline.stage import StageModule
from dsfunc.pipeline.topology import Topology

SINGLE = {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe"}  # torch.distributed.pipelining's class names
MULTI = {"Interleaved1F1B": "ScheduleInterleaved1F1B"}


def make_schedule(name: str, module: StageModule, topology: Topology, device: torch.device, micro_batches: int,
                  loss_fn: Callable[..., torch.Tensor]) -> Any:
    """The schedule ``name`` over this rank's ``module`` (the pipeline group joins the ranks)."""
    # imported here, not with dsfunc: it imports torch._dynamo, about a third of `import dsfunc`'s time
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    if name in SINGLE:
        if module.stages_per_rank != 1:
            raise InputError(f'the "{name}" schedule runs one stage per rank, but stages_per_rank is '
                             f'{module.stages_per_rank}: use "Interleaved1F1B" or stages_per_rank 1')
        stage = PipelineStage(module, topology.stage, module.num_stages, device, group=topology.pipe_group)
        schedule = getattr(pipelining, SINGLE[name])
        return schedule(stage, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
    stages = [PipelineStage(chunk, index, module.num_stages, device, group=topology.pipe_group)
              for chunk, index in zip(module.chunks(), module.held_stages)]
    schedule = getattr(pipelining, MULTI[name])
    return schedule(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
