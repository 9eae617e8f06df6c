"""The schedules a pipelined step runs: ``torch.distributed.pipelining``'s, by their DeepSpeed-style names.

One rank holds one stage, so the single-stage schedules apply: ``"1F1B"`` (one forward, one backward, as
DeepSpeed's ``TrainSchedule``; the default) and ``"GPipe"`` (every forward, then every backward).
Gradient scaling is dsfunc's (the loss carries the micro-batch and replica means), so torch's
``scale_grads`` is off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dsfunc.pipeline.topology import Topology

SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}


def make_schedule(name: str, module: nn.Module, topology: Topology, device: torch.device, micro_batches: int,
                  loss_fn: Callable[..., torch.Tensor]) -> Schedule1F1B | ScheduleGPipe:
    """The schedule ``name`` over this rank's stage ``module`` (the pipeline group joins the stages)."""
    stage = PipelineStage(module, topology.stage, topology.stages, device, group=topology.pipe_group)
    return SCHEDULES[name](stage, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
