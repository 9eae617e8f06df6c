"""The static half of a training state: its :class:`Program`.

A :class:`~dsfunc.TrainState`'s leaves are its data; its program is what never changes during a run and is
never checkpointed as tensors — the parsed config, the model skeleton, the sharding plan, the update, the
loss scaler's rule and the composed step. What changes during the run (the workspace of compute copies, where
gradients and the update live, the pipeline stage) is one :class:`~dsfunc.run.RunContext`, which the program
points at. :func:`dsfunc.init_state` builds both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dsfunc.batch import LossFn
from dsfunc.config import Config
from dsfunc.distributed.mesh import Mesh
from dsfunc.optim.fused import FusedAdam
from dsfunc.optim.update import ChainUpdate
from dsfunc.run import RunContext
from dsfunc.scaling import LossScaler
from dsfunc.zero.binding import Binding
from dsfunc.zero.layout import ShardingPlan

if TYPE_CHECKING:
    from dsfunc.parallel.tensor import TensorParallel

# train_step's signature, (state, batch, ...) -> state; TrainState is not named here because the state's
# module names this one
StepFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """Everything static about a run (identity-compared, so states of one run share a treedef)."""

    config: Config
    plan: ShardingPlan
    skeleton: nn.Module
    binding: Binding
    run: RunContext  # the run's mutable context (dsfunc.run)
    update: ChainUpdate | FusedAdam
    scaler: LossScaler
    loss_fn: LossFn | None
    device: torch.device
    compute_dtype: torch.dtype
    comm_dtype: torch.dtype
    persistent_buffers: tuple[str, ...]
    step_fn: StepFn
    segment_norm: Callable[[Any], Any] | None = None
    mesh: Mesh | None = None  # the run's axes and groups (dsfunc.distributed.mesh)
    tensor: TensorParallel | None = None  # the parameters split over the mesh's tp axis (dsfunc.parallel.tensor)
