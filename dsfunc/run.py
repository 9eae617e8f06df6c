"""The run's mutable context: what a :class:`~dsfunc.program.Program` points at but is not static.

A :class:`RunContext` is made once by :func:`dsfunc.init_state` and shared by every state of the run. Its
lifecycle: built with the :class:`~dsfunc.zero.gather.Workspace` and the policies of
:mod:`dsfunc.zero.policy` (:meth:`RunContext.build`); read by each step at fixed points (the reducer's
:attr:`~RunContext.grads`, the update's :attr:`~RunContext.runner`, the workspace's copies); and waited for
where host work may still be in flight — explicitly, by the next step, a checkpoint, ``full_params``
(:meth:`RunContext.wait`). Reading a state's fields never waits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from dsfunc.zero.gather import Workspace
from dsfunc.zero.layout import ShardingPlan
from dsfunc.zero.policy import GradStore, Placement, UpdateRunner


class Pipeline(Protocol):
    """What the step, checkpoints and ``full_params`` ask of this rank's pipeline stage
    (:class:`dsfunc.pipeline.runtime.Pipeline`, which builds on the step and so is not imported here)."""

    topology: Any  # dsfunc.pipeline.topology.Topology

    def norm_and_loss(self, plan: ShardingPlan, grads: Mapping[str, torch.Tensor],
                      loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def gather_stages(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def whole_model(self, meta: dict[str, Any]) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True, eq=False)
class RunContext:
    """The workspace of compute copies, where gradients and the update live, and this rank's pipeline stage."""

    workspace: Workspace
    placement: Placement  # where the config puts the step's data and work
    grads: GradStore  # where a unit's gradient sum waits between micro-batches
    runner: UpdateRunner  # who runs the update
    pipeline: Pipeline | None = None  # this rank's stage when the model is pipelined

    @classmethod
    def build(cls, workspace: Workspace, placement: Placement, pipeline: Pipeline | None = None) -> RunContext:
        """The context of a run whose copies ``workspace`` caches (built with ``placement.shards``)."""
        return cls(workspace=workspace, placement=placement, grads=placement.grads,
                   runner=placement.runner(workspace), pipeline=pipeline)

    def wait(self) -> None:
        """Return once no host work of the last step is in flight (the masters and optimizer state are final)."""
        self.workspace.settle()

    def host_bytes(self) -> int:
        """Host bytes of the run's buffers besides the masters and optimizer state."""
        return self.runner.host_bytes()
