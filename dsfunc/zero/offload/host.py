"""The host side of a run with the optimizer offloaded: its parts, and how the config makes them.

With ``offload_optimizer: {"device": "cpu"}`` the state's ``params`` and ``opt_state`` live in host memory while
forward and backward run on the compute device. A :class:`HostOffload` owns the host side of that traffic, reused
every step; :mod:`dsfunc.zero.offload.placement` gives the step the three policies of
:mod:`dsfunc.zero.policy` made of its parts: gradients out (:mod:`~dsfunc.zero.offload.grads`,
:mod:`~dsfunc.zero.offload.device_sums`), the update on the host (:mod:`~dsfunc.zero.offload.runner`,
:mod:`~dsfunc.zero.offload.executor`, :mod:`~dsfunc.zero.offload.speculation`), parameters back
(:mod:`~dsfunc.zero.offload.staging`, :mod:`~dsfunc.zero.offload.shards`).

The same path runs when the compute device is the CPU (the tests' case): the host buffers are separate
tensors, the copies are real copies and the update is the host one, so nothing of it goes untested.
"""

from __future__ import annotations

import logging

import torch

from dsfunc.config import ZeroConfig
from dsfunc.config.dtypes import SIXTEEN_BIT
from dsfunc.pinned import HostMemory
from dsfunc.zero.layout import ShardingPlan
from dsfunc.zero.offload.device_sums import DeviceSums, device_sum_units
from dsfunc.zero.offload.executor import HostExecutor
from dsfunc.zero.offload.grads import HostGrads
from dsfunc.zero.offload.shards import HostShards
from dsfunc.zero.offload.speculation import Speculation
from dsfunc.zero.offload.staging import ShardStaging

logger = logging.getLogger("dsfunc")


class HostOffload:
    """The host buffers of a run with the optimizer offloaded, and the copies and update that use them."""

    def __init__(self, plan: ShardingPlan, *, compute_device: torch.device, compute_dtype: torch.dtype,
                 pin_memory: bool, stream_params: bool, grad_dtype: torch.dtype = torch.float32,
                 device_sum_elements: int = 0, micro_batches_per_backward: int = 1, micro_batches: int = 1,
                 speculative: bool | int = False, master_dtype: torch.dtype = torch.float32) -> None:
        self.plan = plan
        self.compute_device = compute_device
        self.memory = HostMemory(pin_memory and torch.cuda.is_available())
        self.executor = HostExecutor(compute_device)  # the update of lazy units, in the background
        # each unit's update ahead of the step, as its gradient lands (offload_optimizer.speculative_update)
        self.speculation = (Speculation(self.executor, wait_start=compute_device.type != "cuda",
                                        elements=None if speculative is True else speculative)
                            if speculative else None)
        # gradients out on a GPU: the stream their copies to the host run on
        copies = torch.cuda.Stream(compute_device) if compute_device.type == "cuda" else None
        self.device_sums = DeviceSums(plan, device_sum_units(plan, device_sum_elements), memory=self.memory,
                                      grad_bytes=grad_dtype.itemsize, copies=copies)
        self.grads = HostGrads(plan, memory=self.memory, compute_device=compute_device,
                               grad_bytes=grad_dtype.itemsize, device_sums=self.device_sums, executor=self.executor,
                               copies=copies, micro_batches_per_backward=micro_batches_per_backward,
                               micro_batches=micro_batches, speculation=self.speculation)
        over_grads = grad_dtype == compute_dtype and compute_dtype in SIXTEEN_BIT and not stream_params
        self.staging = ShardStaging(plan, memory=self.memory, compute_device=compute_device,
                                    compute_dtype=compute_dtype, stream_params=stream_params, over_grads=over_grads,
                                    master_dtype=master_dtype)
        self.shards = HostShards(self.staging, self.executor)

    @classmethod
    def from_config(cls, plan: ShardingPlan, zero: ZeroConfig, *, compute_device: torch.device,
                    compute_dtype: torch.dtype, grad_dtype: torch.dtype, micro_batches: int,
                    master_dtype: torch.dtype = torch.float32) -> HostOffload | None:
        """The host side for ``zero``'s offload sections, or None when the optimizer is not offloaded.
        ``grad_dtype``: what the host gradient buffers are expected to hold (for the memory estimate);
        ``master_dtype``: the masters' (bf16 ones in the compute dtype are the shards ``offload_param`` streams)."""
        section = zero.offload_optimizer
        if section is None:
            return None
        budget = section.grad_accumulation_on_device
        if budget and zero.stage == 1:
            logger.warning("offload_optimizer.grad_accumulation_on_device has no effect at stage 1, which sums "
                           "micro-batches on the device anyway")
            budget = 0
        per_backward = section.micro_batches_per_backward
        if per_backward > 1 and zero.stage == 1:
            logger.warning("offload_optimizer.micro_batches_per_backward has no effect at stage 1, which sums "
                           "micro-batches on the device anyway")
            per_backward = 1
        host = cls(plan, compute_device=compute_device, compute_dtype=compute_dtype, pin_memory=section.pin_memory,
                   stream_params=zero.offload_param is not None, grad_dtype=grad_dtype,
                   device_sum_elements=budget, micro_batches_per_backward=per_backward, micro_batches=micro_batches,
                   speculative=section.speculative_update, master_dtype=master_dtype)
        if budget and not host.device_sums.units:
            logger.warning("offload_optimizer.grad_accumulation_on_device = %d is smaller than every unit's gradient "
                           "shard (the smallest has %d elements): every sum goes to the host", budget,
                           min(plan.shard_size(u) for u in plan.units))
        return host

    def summary(self) -> str:
        """What the startup summary says of where things live beyond the masters and optimizer state."""
        return ((", parameters streamed from the host" if self.staging.stream_params else "")
                + (f"; the gradient sums of {len(self.device_sums.units)} unit(s) wait on the device until the "
                   "update reads them" if self.device_sums.units else "")
                + ("; each unit's update starts as its gradient lands, redone if the step clips or skips"
                   if self.speculation is not None else ""))

    def host_bytes(self) -> int:
        """Host bytes of the buffers besides the masters and optimizer state: gradient and parameter shards, and
        the copies a speculative update saves (once made: their size is the optimizer's)."""
        on_device = sum(self.plan.shard_size(self.plan.unit(n)) for n in self.device_sums.units)
        sent = sum(self.plan.shard_size(u) for u in self.plan.units) - on_device
        lowp = torch.empty((), dtype=self.staging.compute_dtype).element_size()
        saved = self.speculation.host_bytes() if self.speculation is not None else 0
        return ((sent + self.device_sums.host_elements()) * self.grads.grad_bytes + self.staging.host_elements() * lowp
                + saved)

    def buffers(self) -> list[torch.Tensor]:
        """The host buffers held now besides the masters and optimizer state (what :meth:`host_bytes` counts)."""
        saved = self.speculation.buffers() if self.speculation is not None else []
        return [*self.grads.buffers(), *self.device_sums.buffers.all, *self.staging.buffers(), *saved]

