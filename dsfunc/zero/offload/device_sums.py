"""The gradient sums that wait on the device until the update reads them (``grad_accumulation_on_device``).

As many units as ``offload_optimizer.grad_accumulation_on_device`` elements let keep their gradient sums on the
device, after the last micro-batch too: those units have no host gradient buffer. Just before the update reaches
such a unit, :meth:`DeviceSums.read` copies its sum into one of two host buffers, while the update of the one
before runs, so their last copy leaves backward's busy PCIe for the update's idle one.
"""

from __future__ import annotations

import itertools

import torch

from dsfunc.pinned import HostMemory
from dsfunc.zero.layout import ShardingPlan


def device_sum_units(plan: ShardingPlan, elements: int) -> frozenset[str]:
    """The units whose gradient sums fit in ``elements`` together, taken whole in the order backward reaches
    them (the plan's last first), skipping any too large for what is left."""
    chosen, left = [], elements
    for unit in reversed(plan.units):
        if 0 < plan.shard_size(unit) <= left:
            chosen.append(unit.name)
            left -= plan.shard_size(unit)
    return frozenset(chosen)


class DeviceSums:
    """The units whose sums wait on the device, and the host buffers the update reads them through."""

    def __init__(self, plan: ShardingPlan, units: frozenset[str], *, memory: HostMemory, grad_bytes: int,
                 copies: torch.cuda.Stream | None) -> None:
        self.plan = plan
        self.units = units
        self.grad_bytes = grad_bytes
        self._copies = copies  # the stream the copies to the host run on (None: the compute device is the CPU)
        self._waiting: dict[str, torch.Tensor] = {}  # unit -> its final gradient, on the device until read
        self._arriving: dict[str, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # unit -> buffer, copy landed
        self.buffers = ReadBuffers(memory, self._largest_bytes())
        # unit -> the unit the update reads next (plan order: the update's), copied in meanwhile
        order = [u.name for u in plan.units if u.name in units]
        self._next = dict(itertools.pairwise(order))

    def _largest_bytes(self) -> int:
        return max((self.plan.shard_size(self.plan.unit(n)) for n in self.units), default=0) * self.grad_bytes

    def begin_step(self) -> None:
        """Forget the last step's sums: its update, which read through the buffers, is done."""
        self._waiting, self._arriving = {}, {}
        self.buffers.release_all()

    def wait_there(self, name: str, grad: torch.Tensor) -> None:
        """Unit ``name``'s final gradient ``grad`` waits on the device until :meth:`read`."""
        self._waiting[name] = grad

    def unread(self, name: str) -> bool:
        """Whether unit ``name``'s gradient still waits on the device (or is on its way to a buffer)."""
        return name in self._waiting or name in self._arriving

    def read(self, name: str) -> torch.Tensor:
        """Unit ``name``'s final gradient in a host buffer, once its copy there has landed; the copy of the unit
        the update reads next starts now, into the other buffer, beside this unit's update."""
        buf, landed = self._arriving.pop(name, None) or self._copy(name)
        if landed is not None:
            landed.synchronize()
        after = self._next.get(name)
        if after in self._waiting and self.buffers.available():
            self._arriving[after] = self._copy(after)
        return buf

    def _copy(self, name: str) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        grad = self._waiting.pop(name)
        buf, sent = self.buffers.take(name, grad.numel(), grad.dtype)
        if self._copies is None:
            return buf.copy_(grad), None
        if sent is not None:
            self._copies.wait_event(sent)  # the shard the update wrote over the buffer's last gradient has gone
        with torch.cuda.stream(self._copies):  # collect() synchronized the stream that made it
            buf.copy_(grad, non_blocking=True)
        grad.record_stream(self._copies)  # its memory is reused only once the copy has read it
        landed = torch.cuda.Event()
        landed.record(self._copies)
        return buf, landed

    def done(self, name: str, after: torch.cuda.Event | None) -> None:
        """The update has read unit ``name``'s gradient: a buffer it held is free for the next unit, once the copy
        ``after`` (of the new shard the update wrote over it) has landed."""
        self.buffers.release(name, after=after)

    def device_bytes(self) -> int:
        """Device bytes of these sums, held until the update reads them."""
        return self.grad_bytes * sum(self.plan.shard_size(self.plan.unit(name)) for name in self.units)

    def host_elements(self) -> int:
        """Elements of the host buffers the update reads these sums through (an update that reads every gradient
        at once, a chain's, takes a buffer per unit instead)."""
        sizes = [self.plan.shard_size(self.plan.unit(name)) for name in self.units]
        return max(sizes, default=0) * min(ReadBuffers.count, len(sizes))


class ReadBuffers:
    """Host buffers the waiting sums are read through, reused in turn: one per unit being read, a new one when
    none is free, as large as the largest such sum in the expected gradient dtype (or the request, if larger)."""

    count = 2  # what the host Adam needs: the unit it updates, and the next one's copy in flight

    def __init__(self, memory: HostMemory, nbytes: int) -> None:
        self._memory = memory
        self._nbytes = nbytes
        self.free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # a buffer, and the copy out to wait for
        self._taken: dict[str, torch.Tensor] = {}
        self.all: list[torch.Tensor] = []

    def take(self, name: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A buffer for ``numel`` elements of ``dtype``, and the copy out of it that writing it must wait for."""
        nbytes = numel * dtype.itemsize
        free = next((f for f in self.free if f[0].numel() >= nbytes), None)
        if free is None:
            buf, sent = self._memory.empty(max(self._nbytes, nbytes), torch.uint8), None
            self.all.append(buf)
        else:
            self.free.remove(free)
            buf, sent = free
        self._taken[name] = buf
        return buf[:nbytes].view(dtype), sent

    def available(self) -> bool:
        """True when :meth:`take` needs no buffer beyond :attr:`count`."""
        return bool(self.free) or len(self.all) < self.count

    def release(self, name: str, after: torch.cuda.Event | None = None) -> None:
        buf = self._taken.pop(name, None)
        if buf is not None:
            self.free.append((buf, after))

    def release_all(self) -> None:
        for name in list(self._taken):
            self.release(name)
