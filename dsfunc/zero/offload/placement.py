"""Where the config puts a run's data and work: on the host with ``offload_optimizer``, else on the device."""

from __future__ import annotations

import torch

from dsfunc.config import ZeroConfig
from dsfunc.zero.layout import ShardingPlan
from dsfunc.zero.offload.host import HostOffload
from dsfunc.zero.offload.runner import HostRunner
from dsfunc.zero.policy import Placement


def placement(plan: ShardingPlan, zero: ZeroConfig, *, compute_device: torch.device, compute_dtype: torch.dtype,
              grad_dtype: torch.dtype, micro_batches: int, master_dtype: torch.dtype = torch.float32) -> Placement:
    """The step's policies: with the optimizer offloaded, gradients to the host, the update there and shards
    staged back from it (a :class:`HostOffload`'s parts); else everything on ``compute_device``."""
    host = HostOffload.from_config(plan, zero, compute_device=compute_device, compute_dtype=compute_dtype,
                                   grad_dtype=grad_dtype, micro_batches=micro_batches, master_dtype=master_dtype)
    if host is None:
        return Placement.on_device(compute_device, compute_dtype)
    return Placement(grads=host.grads, shards=host.shards, runner=lambda workspace: HostRunner(host, workspace),
                     masters=torch.device("cpu"), summary=host.summary())
