"""The static half of a training state: its :class:`Program`.

A :class:`~dsfunc.TrainState`'s leaves are its data; its program is what never changes during a run and is
never checkpointed as tensors — the parsed config, the model skeleton, the sharding plan, the update, the
loss scaler's rule and the composed step. The program's one mutable member is its
:class:`~dsfunc.zero.gather.Workspace`, the run's cache of compute copies (see there).
:func:`dsfunc.init_state` builds it.
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
from dsfunc.scaling import LossScaler
from dsfunc.zero.binding import Slots
from dsfunc.zero.gather import Workspace
from dsfunc.zero.layout import ShardingPlan
from dsfunc.zero.offload import HostOffload

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
    slots: Slots
    workspace: Workspace
    update: ChainUpdate | FusedAdam
    scaler: LossScaler
    loss_fn: LossFn | None
    device: torch.device
    compute_dtype: torch.dtype
    comm_dtype: torch.dtype
    persistent_buffers: tuple[str, ...]
    step_fn: StepFn
    segment_norm: Callable[[Any], Any] | None = None
    offload: HostOffload | None = None  # the host side when the optimizer is offloaded (dsfunc.zero.offload)
    # this rank's stage when the model is pipelined: a dsfunc.pipeline.runtime.Pipeline (not named here: that
    # module builds on the step, whose program this is)
    pipeline: Any = None
    mesh: Mesh | None = None  # the run's axes and groups (dsfunc.distributed.mesh)
    tensor: TensorParallel | None = None  # the parameters split over the mesh's tp axis (dsfunc.parallel.tensor)
