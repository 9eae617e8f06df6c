"""Gradients out: each unit's reduced gradient shard to a host buffer as its reduction lands.

:class:`HostGrads` is ZeRO-Offload's :class:`~dsfunc.zero.policy.GradStore`. A unit's reduced shard is copied
to its host buffer as soon as its reduction lands (:meth:`HostGrads.put`, non-blocking, on a copy stream of
its own so that backward's kernels go on beside it; at most :attr:`HostGrads.copies_in_flight` units' copies
are queued before the compute stream waits, so the device gradients they read stay few). With accumulation
the sum a unit's next micro-batch adds to comes back on a second stream while the unit before it runs backward
(:meth:`HostGrads.take`). The sums of the units in :attr:`DeviceSums.units` (``grad_accumulation_on_device``)
stay on the device instead, after the last micro-batch too, until the update reads them
(:mod:`dsfunc.zero.offload.device_sums`). The sum of squares for the global norm is taken on the device after
the last micro-batch, so only one number per unit is summed there (three with tensor parallelism:
:func:`dsfunc.zero.norms.unit_sumsq`).

The buffer holds the narrowest dtype that holds the gradient exactly (:func:`dsfunc.zero.reduce.exact_dtype`:
16 bits for one micro-batch on one rank, or with 16-bit communication), half the host bytes of fp32 and the
same numbers; with accumulation the first micro-batch's sum goes out in it too (a 16-bit view of the unit's
fp32 buffer), half the bytes over PCIe both ways.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping

import torch

from dsfunc.pinned import HostMemory
from dsfunc.zero.layout import ShardingPlan, Unit
from dsfunc.zero.norms import unit_sumsq
from dsfunc.zero.offload.device_sums import DeviceSums
from dsfunc.zero.offload.executor import HostExecutor
from dsfunc.zero.offload.speculation import Speculation


class HostGrads:
    """The host buffers of the units' gradient sums, and the copies to and from them."""

    copies_in_flight = 2  # units' gradient copies to the host queued on the copy stream beside backward
    off_device = True

    def __init__(self, plan: ShardingPlan, *, memory: HostMemory, compute_device: torch.device, grad_bytes: int,
                 device_sums: DeviceSums, executor: HostExecutor, copies: torch.cuda.Stream | None,
                 micro_batches_per_backward: int, micro_batches: int, speculation: Speculation | None = None) -> None:
        self.plan = plan
        self.memory = memory
        self.compute_device = compute_device
        self.grad_bytes = grad_bytes  # per element of a host gradient buffer, as the config lets expect
        self.device_sums = device_sums
        self.micro_batches_per_backward = micro_batches_per_backward  # micro-batches whose backward runs unit by unit
        self.micro_batches = micro_batches
        self._executor = executor  # the last step's update may still read a buffer
        self.speculation = speculation  # each unit's update starts as its last sum lands (speculative_update)
        self._storage: dict[str, torch.Tensor] = {}  # unit -> the bytes of its host gradient buffer
        self._grads: dict[str, torch.Tensor] = {}  # unit -> its gradient shard there, in the dtype it came in
        self._sumsq: dict[str, torch.Tensor] = {}  # unit -> sum of squares of its gradient (device)
        self._copies = _CopyQueue(copies, compute_device, self.copies_in_flight)
        self._fetches = torch.cuda.Stream(compute_device) if compute_device.type == "cuda" else None  # sums back
        self._fetched: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}  # unit -> sum on its way back
        # unit -> the unit whose sum backward fetches next: the one before it in the plan that stays not
        fetched = [u.name for u in plan.units if u.name not in device_sums.units]
        self._before = dict(zip(fetched[1:], fetched[:-1]))

    def stays(self, name: str) -> bool:
        """Whether unit ``name``'s sum waits on the device (:class:`DeviceSums`) rather than in host memory."""
        return name in self.device_sums.units

    def device_bytes(self, kept: int) -> int:
        """Device bytes of the sums at the end of a step: all of them (``kept``) where stage 1 sums micro-batches
        on the device, else those that stay there."""
        return kept if self.plan.stage <= 1 and self.micro_batches > 1 else self.device_sums.device_bytes()

    @torch.no_grad()
    def put(self, unit: Unit, grad: torch.Tensor, dtype: torch.dtype = torch.float32,
            last: bool = True) -> torch.Tensor:
        """Start copying ``unit``'s reduced gradient shard (its sum so far) to its host buffer (returned) in
        ``dtype``, which holds it exactly, after taking its sum of squares on the device when it is the
        ``last`` micro-batch's. The caller may drop ``grad`` at once (the copy is ordered on its stream). A
        later call for the same unit (the next micro-batch, another backward) replaces both."""
        if last:
            self._sumsq[unit.name] = unit_sumsq(self.plan, unit, grad)
        self._executor.wait_unit(unit.name)  # the last step's update may still read the buffer
        if self.speculation is not None:  # and this step's, run ahead of it: undone, the buffer is written again
            self.speculation.release(unit.name)
        nbytes = grad.numel() * dtype.itemsize
        storage = self._storage.get(unit.name)
        if storage is None or storage.numel() < nbytes:  # bytes for the widest dtype the unit's sums come in
            if storage is not None:
                self.memory.release(storage)
            storage = self._storage[unit.name] = self.memory.empty(
                grad.numel() * max(self.grad_bytes, dtype.itemsize), torch.uint8)
        buf = self._grads[unit.name] = storage[:nbytes].view(dtype)
        self._copies.copy(unit.name, buf, grad)
        if last and self.speculation is not None:
            self.speculation.landed(unit.name, buf, self._copies.landed.get(unit.name))
        return buf

    def take(self, unit: Unit, buf: torch.Tensor) -> torch.Tensor:
        """``unit``'s gradient sum so far (``buf``, what :meth:`put` returned) back on the compute device in
        fp32, once its copy out has landed (the next micro-batch adds to it). On a GPU the copy back runs on the
        fetch stream, and the sum of the unit backward reaches next (the one before it in the plan) starts
        coming back at once, so that copy runs beside this unit's backward."""
        if self._fetches is None:
            return buf.to(self.compute_device, torch.float32, non_blocking=True)
        fetched = self._fetched.pop(unit.name, None)
        if fetched is None or fetched[0].numel() != buf.numel() or fetched[0].dtype != buf.dtype:
            fetched = self._start_take(unit.name, buf)
        out, landed = fetched
        torch.cuda.current_stream(self.compute_device).wait_event(landed)
        before = self._before.get(unit.name)
        if before is not None and before in self._grads and before not in self._fetched:
            self._fetched[before] = self._start_take(before, self._grads[before])
        return out.float()

    def _start_take(self, name: str, buf: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Copy host ``buf`` (unit ``name``'s) into a new device tensor on the fetch stream, after its copy out."""
        out = torch.empty(buf.numel(), dtype=buf.dtype, device=self.compute_device)
        self._fetches.wait_stream(torch.cuda.current_stream(self.compute_device))  # out's memory is free to write
        done = self._copies.landed.get(name)
        if done is not None:
            self._fetches.wait_event(done)
        with torch.cuda.stream(self._fetches):
            out.copy_(buf, non_blocking=True)
        out.record_stream(self._fetches)
        landed = torch.cuda.Event()
        landed.record(self._fetches)
        return out, landed

    @torch.no_grad()
    def collect(self, grads: Mapping[str, torch.Tensor | None]) -> tuple[HostGradMap, torch.Tensor]:
        """Every unit's gradient in host memory (copied now where the reducer did not already) once the copies
        have landed, and the sum of squares of them all, on the compute device."""
        out: dict[str, torch.Tensor | None] = {}
        sums = []
        self.device_sums.begin_step()  # the last step's update, which read through its buffers, is done
        for name, grad in grads.items():
            if grad is not None and grad is not self._grads.get(name):
                if name in self.device_sums.units:  # on the device until the update reads it
                    self._sumsq[name] = unit_sumsq(self.plan, self.plan.unit(name), grad)
                    self.device_sums.wait_there(name, grad)
                else:
                    grad = self.put(self.plan.unit(name), grad)
            if grad is not None:
                sums.append(self._sumsq[name])
            out[name] = grad
        self._sumsq = {}
        if self.compute_device.type == "cuda":
            torch.cuda.current_stream(self.compute_device).synchronize()  # the host reads them next
            self._copies.synchronize()
            self._fetched = {}
        return HostGradMap(out, self.device_sums), torch.stack(sums).sum(0)

    def dtypes(self) -> set[torch.dtype]:
        """The dtypes the host gradient buffers hold now."""
        return {g.dtype for g in self._grads.values()}

    def buffers(self) -> list[torch.Tensor]:
        """The host gradient buffers held now."""
        return list(self._storage.values())


class _CopyQueue:
    """Gradient copies to the host on a stream of their own, at most ``limit`` queued before the compute stream
    waits for the oldest (each holds a device gradient until it has read it)."""

    def __init__(self, stream: torch.cuda.Stream | None, device: torch.device, limit: int) -> None:
        self.stream, self.device, self.limit = stream, device, limit
        self.landed: dict[str, torch.cuda.Event] = {}  # unit -> after its last copy out
        self._queued: collections.deque[torch.cuda.Event] = collections.deque()

    def copy(self, name: str, buf: torch.Tensor, grad: torch.Tensor) -> None:
        if self.stream is None:
            buf.copy_(grad, non_blocking=True)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the gradient is made, and the last read of buf (take) is done
        with torch.cuda.stream(self.stream):
            buf.copy_(grad, non_blocking=True)
        grad.record_stream(self.stream)  # its memory is reused only once the copy has read it
        done = self.landed[name] = torch.cuda.Event()
        done.record(self.stream)
        self._queued.append(done)
        if len(self._queued) > self.limit:
            compute.wait_event(self._queued.popleft())  # bounds the device gradients the queue holds

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.landed, self._queued = {}, collections.deque()


class HostGradMap(Mapping):
    """:meth:`HostGrads.collect`'s gradients: host buffers, and those of the units whose sums waited on the device
    read through a host buffer when first asked for (:meth:`DeviceSums.read`)."""

    def __init__(self, grads: dict[str, torch.Tensor | None], device_sums: DeviceSums) -> None:
        self._grads, self._device_sums = grads, device_sums

    def __getitem__(self, name: str) -> torch.Tensor | None:
        if self._device_sums.unread(name):
            self._grads[name] = self._device_sums.read(name)
        return self._grads[name]

    def read(self, name: str) -> torch.Tensor | None:
        """The host gradient handed out for unit ``name``; None while it waits on the device (not yet read)."""
        return None if self._device_sums.unread(name) else self._grads.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)
