"""Parameters back: each unit's new shard cast to the compute dtype on the host and copied to the device.

The cast goes into a host buffer (pinned), half the bytes of the fp32 master, and is copied to the device unit
by unit as the host update writes them (:meth:`dsfunc.zero.offload.runner.StepExecutor.unit_done`), so a unit's
cast and copy overlap the update of the next. With ``offload_param`` at stage 3 that host copy is the only one
between gathers: each gather streams it host to device, so every unit keeps one. Otherwise the device keeps the
shard and the host copy is only a way station. Where the gradient is in the compute dtype
(:attr:`ShardStaging.over_grads`) the update writes the new shard over the gradient it read, element by element,
and the copy goes from there: no buffer at all. Else a few buffers of the largest shard's size
(:attr:`ShardStaging.staging_buffers`) are reused in turn, once the copy out of each has landed, instead of one
per unit (2 bytes a parameter less host memory in bf16).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import torch

from dsfunc.config.dtypes import SIXTEEN_BIT
from dsfunc.pinned import HostMemory
from dsfunc.zero.layout import ShardingPlan, Unit
from dsfunc.zero.offload.grads import HostGradMap


class ShardStaging:
    """The host buffers the new compute-dtype shards pass through on their way to the device."""

    staging_buffers = 3  # host buffers the new 16-bit shards pass through when the device keeps them

    def __init__(self, plan: ShardingPlan, *, memory: HostMemory, compute_device: torch.device,
                 compute_dtype: torch.dtype, stream_params: bool, over_grads: bool,
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.plan = plan
        self.memory = memory
        self.compute_device = compute_device
        self.compute_dtype = compute_dtype
        self.stream_params = stream_params  # offload_param: every unit keeps its host shard, gathers stream it
        # the update writes each unit's new 16-bit shard over the gradient it read (same dtype, element by element),
        # which then is the copy's source: no staging buffers (one micro-batch on one rank, or 16-bit reductions)
        self.over_grads = over_grads
        # offload_param with masters in the compute dtype (bf16_master_weights_and_grads): the masters are the shards
        # gathers stream, no copy of them (2 bytes a parameter of host memory less; the copies in are pageable)
        self.masters_sent = stream_params and master_dtype == compute_dtype
        self._staged: dict[str, torch.Tensor] = {}  # unit -> compute-dtype parameter shard (host, 16-bit only)
        self._sent: dict[str, torch.cuda.Event] = {}  # unit -> after the last copy out of its staged shard
        self._buffers: list[torch.Tensor] = []  # without offload_param: the staging buffers, reused in turn
        self._owners: list[str | None] = []  # the unit whose shard each buffer holds
        self._buffer_of: dict[str, int] = {}  # unit -> the buffer holding its shard
        self._unsent: set[str] = set()  # units staged in a buffer whose copy to the device is not yet started
        self._next = 0
        self._largest = 0  # elements of the largest shard: every buffer's size
        self._lock = threading.Lock()  # the background update and the main thread both stage

    def staging(self, unit: Unit, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """``unit``'s host buffer for its compute-dtype shard, once no copy out of it is in flight (None when
        the compute dtype is fp32: the master itself is sent). With :attr:`over_grads` it is ``grad``, the
        gradient the update has just read for the unit, or else (the copies built outside an update, a skipped
        update's cast) a pageable temporary, dropped once sent. Otherwise, without ``offload_param``, it is the
        next staging buffer, which holds the shard until :attr:`staging_buffers` more units have been staged.
        None too where the masters themselves are sent (:attr:`masters_sent`)."""
        if self.compute_dtype not in SIXTEEN_BIT or self.masters_sent:
            return None
        if self.over_grads:
            size = self.plan.shard_size(unit)
            fits = grad is not None and grad.dtype == self.compute_dtype and grad.numel() == size
            buf = self._staged[unit.name] = grad if fits else torch.empty(size, dtype=self.compute_dtype)
            return buf
        if not self.stream_params:
            return self._take_buffer(unit)
        buf = self._staged.get(unit.name)
        if buf is None:
            buf = self._staged[unit.name] = self.memory.empty(self.plan.shard_size(unit), self.compute_dtype)
        self._wait_sent(unit.name)
        return buf

    def _take_buffer(self, unit: Unit) -> torch.Tensor:
        """The buffer ``unit`` holds (staged again: a skipped update's cast) or the next one whose shard has gone."""
        with self._lock:
            i = self._buffer_of.get(unit.name)
            if i is None:
                i = self._free_buffer()
                before, self._owners[i] = self._owners[i], unit.name
                if before is not None:
                    self._wait_sent(before)
                    del self._staged[before], self._buffer_of[before]
                self._buffer_of[unit.name] = i
            else:
                self._wait_sent(unit.name)
            self._unsent.add(unit.name)
            buf = self._staged[unit.name] = self._buffers[i][: self.plan.shard_size(unit)]
            return buf

    def _free_buffer(self) -> int:
        """A new buffer until there are :attr:`staging_buffers`, then the next in turn that holds no shard still to
        be sent (a new one if every buffer does: never met by a step, which sends each unit before staging the
        next)."""
        if not self._buffers:
            self._largest = max(self.plan.shard_size(u) for u in self.plan.units)
        count = len(self._buffers)
        if count >= self.staging_buffers:
            for k in range(count):
                i = (self._next + k) % count
                if self._owners[i] not in self._unsent:
                    self._next = (i + 1) % count
                    return i
        self._buffers.append(self.memory.empty(self._largest, self.compute_dtype))
        self._owners.append(None)
        return count

    def _wait_sent(self, name: str) -> None:
        sent = self._sent.pop(name, None)
        if sent is not None:
            sent.synchronize()

    def after_send(self, name: str) -> torch.cuda.Event | None:
        """The copy out of unit ``name``'s shard that a write over its gradient must wait for (:attr:`over_grads`:
        the shard was written over it), else None."""
        return self._sent.get(name) if self.over_grads else None

    def staging_map(self, grads: HostGradMap) -> Mapping[str, torch.Tensor]:
        """The units' staging buffers as a mapping whose reads stage (:meth:`staging`), each unit's when first
        read: the update asks for a unit's just before writing it, after reading its gradient from ``grads``,
        so a few buffers, or the gradients themselves, serve every unit."""
        return _StagingMap(self, grads)

    @torch.no_grad()
    def stage(self, unit: Unit, src: torch.Tensor) -> torch.Tensor:
        """``unit``'s master shard ``src`` in the compute dtype, in host memory: cast into its host buffer
        (16-bit), or the fp32 master itself."""
        buf = self.staging(unit)
        return src if buf is None else buf.copy_(src)

    def staged(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        """What :meth:`stage` (or the update) last wrote for ``unit`` from its ``master`` shard."""
        if self.compute_dtype not in SIXTEEN_BIT or self.masters_sent:
            return master
        staged = self._staged.get(unit.name)
        if staged is None:
            raise RuntimeError(f"unit {unit.name!r}'s staging buffer was taken by another unit before its shard was "
                               "sent (a dsfunc bug: please report it)")
        return staged

    def send(self, unit: Unit, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A device copy of ``unit``'s staged shard, into ``out`` or a new tensor (non-blocking from pinned
        memory; a real copy on the CPU too)."""
        if out is None:
            out = torch.empty(host.numel(), dtype=self.compute_dtype, device=self.compute_device)
        out.copy_(host, non_blocking=True)
        if out.is_cuda:
            sent = self._sent[unit.name] = torch.cuda.Event()
            sent.record(torch.cuda.current_stream(self.compute_device))
        if self.over_grads:  # a gradient buffer is the next step's again (its copy in waits for this one), a
            self._staged.pop(unit.name, None)  # temporary goes (a pageable copy has read it when this returns)
        with self._lock:
            self._unsent.discard(unit.name)
        return out

    def host_elements(self) -> int:
        """Elements of the staging buffers (of the compute dtype; 0 when it is fp32 or the masters are sent)."""
        if self.compute_dtype not in SIXTEEN_BIT or self.masters_sent:
            return 0
        shards = [self.plan.shard_size(u) for u in self.plan.units]
        if self.stream_params:
            return sum(shards)
        return 0 if self.over_grads else max(shards) * min(self.staging_buffers, len(shards))

    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers held now."""
        return list(self._staged.values()) if self.stream_params else list(self._buffers)


class _StagingMap(Mapping):
    """:meth:`ShardStaging.staging_map`: each unit's staging buffer, taken when first read."""

    def __init__(self, staging: ShardStaging, grads: HostGradMap) -> None:
        self._staging, self._grads = staging, grads
        sixteen = staging.compute_dtype in SIXTEEN_BIT and not staging.masters_sent
        self._names = [u.name for u in staging.plan.units] if sixteen else []
        self._taken: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._taken:
            if name not in self._names:
                raise KeyError(name)
            self._taken[name] = self._staging.staging(self._staging.plan.unit(name), self._grads.read(name))
        return self._taken[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names
