"""ZeRO-Offload: the fp32 masters and optimizer state in host memory, the update on the CPU.

With ``offload_optimizer: {"device": "cpu"}`` the state's ``params`` and ``opt_state`` live in host memory
while forward and backward run on the compute device.
A :class:`HostOffload` owns the host side of that traffic:

* gradients out: each unit's reduced gradient shard is copied to a host buffer as soon as its reduction
  lands (:meth:`HostOffload.put_grad`, non-blocking, on a copy stream of its own so that backward's kernels
  go on beside it; at most :attr:`HostOffload.copies_in_flight` units' copies are queued before the compute
  stream waits, so the device gradients they read stay few; with accumulation the sum a unit's next
  micro-batch adds to comes back on a second stream while the unit before it runs backward:
  :meth:`HostOffload.fetch_grad`; the sums of the units in :attr:`HostOffload.resident`, as many as
  ``grad_accumulation_on_device`` lets, stay on the device instead, after the last micro-batch too, until
  the update reads them: :meth:`HostOffload.held_grad` copies each into one of two host slots just before
  the update reaches its unit, while the update of the one before runs, so those units have no host
  gradient buffer and their last copy leaves backward's busy PCIe for the update's idle one), its sum of
  squares for the global
  norm taken on the device after the last micro-batch, so only one number per unit is summed there; the
  reducer then drops its device copy, so backward holds no gradient shards on the device beyond the
  reductions in flight (at stages 2-3 with gradient accumulation too: :mod:`dsfunc.zero.reduce`; at stage 1
  the micro-batches before the last sum locally in fp32, as without offload).
  The buffer holds the narrowest dtype that holds the gradient exactly
  (:func:`dsfunc.zero.reduce.exact_dtype`: 16 bits for one micro-batch on one rank, or with 16-bit
  communication), half the host bytes of fp32 and the same numbers; with accumulation the first micro-batch's
  sum goes out in it too (a 16-bit view of the unit's fp32 buffer), half the bytes over PCIe both ways;
* the update then runs where the masters are (:mod:`dsfunc.optim.host_adam` for the config's Adam/AdamW);
* parameters back: each unit's new shard is cast to the compute dtype on the host (a pinned buffer) and
  copied to the device (:meth:`HostOffload.stage`, :meth:`HostOffload.send`), half the bytes of the fp32
  master, unit by unit as the host update writes them (:meth:`dsfunc.zero.gather.Workspace.send_updated`),
  so a unit's cast and copy overlap the update of the next. With ``offload_param`` at stage 3
  that host copy is the only one between gathers: each gather streams it host to device, so every unit keeps
  one. Otherwise the device keeps the shard and the host copy is only a way station. Where the gradient is
  in the compute dtype (:attr:`HostOffload.over_grads`) the update writes the new shard over the gradient it
  read, element by element, and the copy goes from there: no buffer at all. Else a few buffers of the
  largest shard's size (:attr:`HostOffload.staging_slots`) are reused in turn, once the copy out of each has
  landed, instead of one per unit (2 bytes a parameter less host memory in bf16).

Only the buffers that take part in copies with the GPU are pinned (the masters and moments are read by
the host alone), and they are pinned at their exact size with ``cudaHostRegister``: torch's pinned
allocator (``pin_memory=True``) rounds every allocation up to a power of two, 1.6x the bytes for a
unit of 79M parameters.

The same path runs when the compute device is the CPU (the tests' case): the host buffers are separate
tensors, the copies are real copies and the update is the host one, so nothing of it goes untested.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping

import torch

from dsfunc import kernels
from dsfunc.config import ZeroConfig
from dsfunc.zero.host_update import PendingUpdate
from dsfunc.zero.layout import ShardingPlan, Unit

logger = logging.getLogger("dsfunc")
_LOWP = (torch.bfloat16, torch.float16)


class _Pinned:
    """Host tensors page-locked at their exact size, unlocked when released or when their owner goes."""

    def __init__(self, owner: object) -> None:
        self.ptrs: set[int] = set()
        self.failed = False
        weakref.finalize(owner, _Pinned._unregister_all, self.ptrs)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        if self.failed or out.numel() == 0:
            return out
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(out.data_ptr(), out.numel() * out.element_size(), 0)) != 0:
            self.failed = True  # e.g. the locked-memory limit (ulimit -l): pageable copies are slower, not wrong
            logger.warning("offload: page-locking %d host bytes failed; host buffers stay pageable", out.nbytes)
            return out
        self.ptrs.add(out.data_ptr())
        return out

    def release(self, tensor: torch.Tensor) -> None:
        """Unlock ``tensor`` before it is dropped, once the device is done with it."""
        if tensor.data_ptr() in self.ptrs:
            torch.cuda.synchronize()  # a non-blocking copy into or out of it may still be in flight
            self.ptrs.discard(tensor.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    @staticmethod
    def _unregister_all(ptrs: set[int]) -> None:
        # Runs as the owner goes, while its buffers are still referenced by its attributes. A buffer that
        # outlives it is pageable memory from then on: copies with it are synchronous, still correct.
        if ptrs:
            torch.cuda.synchronize()
        for ptr in ptrs:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        ptrs.clear()


class HostOffload:
    """The host buffers of a run with the optimizer offloaded, reused every step."""

    copies_in_flight = 2  # units' gradient copies to the host queued on the copy stream beside backward
    staging_slots = 3  # host buffers the new 16-bit shards pass through when the device keeps them

    def __init__(self, plan: ShardingPlan, *, compute_device: torch.device, compute_dtype: torch.dtype,
                 pin_memory: bool, params: bool, grad_dtype: torch.dtype = torch.float32,
                 resident_elements: int = 0, backward_group: int = 1) -> None:
        self.plan = plan
        self.backward_group = backward_group  # micro-batches whose backward runs unit by unit (micro_batches_per_backward)
        self.resident = _resident_units(plan, resident_elements)  # units whose sums wait on the device
        self.device = torch.device("cpu")  # where the masters and optimizer state live
        self.compute_device = compute_device
        self.compute_dtype = compute_dtype
        self.pin = pin_memory and torch.cuda.is_available()
        self.params = params  # offload_param: no device copy of a stage-3 unit's shard between its gathers
        self.grad_bytes = grad_dtype.itemsize  # per element of a host gradient buffer, as the config lets expect
        # the update writes each unit's new 16-bit shard over the gradient it read (same dtype, element by element),
        # which then is the copy's source: no staging buffers (one micro-batch on one rank, or 16-bit reductions)
        self.over_grads = grad_dtype == compute_dtype and compute_dtype in _LOWP and not params
        self._pinned = _Pinned(self) if self.pin else None
        self._storage: dict[str, torch.Tensor] = {}  # unit -> the bytes of its host gradient buffer
        self._held: dict[str, torch.Tensor] = {}  # resident unit -> its final gradient, on the device until read
        self._holding: dict[str, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # unit -> slot, copy landed
        self._grad_slots = _Slots(self)  # the host buffers the held gradients are read through
        # resident unit -> the resident unit the update reads next (plan order: the update's), copied in meanwhile
        held = [u.name for u in plan.units if u.name in self.resident]
        self._held_next = dict(itertools.pairwise(held))
        self._grads: dict[str, torch.Tensor] = {}  # unit -> its gradient shard there, in the dtype it came in
        self._lowp: dict[str, torch.Tensor] = {}  # unit -> compute-dtype parameter shard (host, 16-bit only)
        self._sumsq: dict[str, torch.Tensor] = {}  # unit -> sum of squares of its gradient (device)
        self._sent: dict[str, torch.cuda.Event] = {}  # unit -> after the last copy out of its staged shard
        self._slots: list[torch.Tensor] = []  # without offload_param: the staging buffers, reused in turn
        self._owners: list[str | None] = []  # the unit whose shard each slot holds
        self._slot_of: dict[str, int] = {}  # unit -> the slot holding its shard
        self._unsent: set[str] = set()  # units staged in a slot whose copy to the device is not yet started
        self._next_slot = 0
        self._largest = 0  # elements of the largest shard: every slot's size
        self._slot_lock = threading.Lock()  # the background update and the main thread both stage
        self.pending = PendingUpdate(compute_device)  # the update of lazy units, in the background
        # offload_param on a GPU: the stream that gathers copy host shards in on, beside the compute stream
        self.transfer = torch.cuda.Stream(compute_device) if params and compute_device.type == "cuda" else None
        # gradients out on a GPU: the stream their copies to the host run on, and when each unit's landed
        self.copies = torch.cuda.Stream(compute_device) if compute_device.type == "cuda" else None
        self.fetches = torch.cuda.Stream(compute_device) if compute_device.type == "cuda" else None  # sums back
        self._copied: dict[str, torch.cuda.Event] = {}
        self._queued: collections.deque[torch.cuda.Event] = collections.deque()
        self._fetched: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}  # unit -> sum on its way back
        # unit -> the unit whose sum backward fetches next: the one before it in the plan that is not resident
        fetched = [u.name for u in plan.units if u.name not in self.resident]
        self._before = dict(zip(fetched[1:], fetched[:-1]))

    @classmethod
    def from_config(cls, plan: ShardingPlan, zero: ZeroConfig, *, compute_device: torch.device,
                    compute_dtype: torch.dtype, grad_dtype: torch.dtype) -> HostOffload | None:
        """The host side for ``zero``'s offload sections, or None when the optimizer is not offloaded.
        ``grad_dtype``: what the host gradient buffers are expected to hold (for the memory estimate)."""
        section = zero.offload_optimizer
        if section is None:
            return None
        budget = section.grad_accumulation_on_device
        if budget and zero.stage == 1:
            logger.warning("offload_optimizer.grad_accumulation_on_device has no effect at stage 1, which sums "
                           "micro-batches on the device anyway")
            budget = 0
        group = section.micro_batches_per_backward
        if group > 1 and zero.stage == 1:
            logger.warning("offload_optimizer.micro_batches_per_backward has no effect at stage 1, which sums "
                           "micro-batches on the device anyway")
            group = 1
        host = cls(plan, compute_device=compute_device, compute_dtype=compute_dtype, pin_memory=section.pin_memory,
                   params=zero.offload_param is not None, grad_dtype=grad_dtype,
                   resident_elements=budget, backward_group=group)
        if budget and not host.resident:
            logger.warning("offload_optimizer.grad_accumulation_on_device = %d is smaller than every unit's gradient "
                           "shard (the smallest has %d elements): every sum goes to the host", budget,
                           min(plan.shard_size(u) for u in plan.units))
        return host

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for copies with the compute device: pinned when that is a GPU and pinning is on."""
        return torch.empty(numel, dtype=dtype) if self._pinned is None else self._pinned.empty(numel, dtype)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (a master shard as it is materialised; pageable: only the host reads it)."""
        return tensor.reshape(-1).to(self.device, copy=True).view(tensor.shape)

    # -- gradients out ------------------------------------------------------------------------------
    @torch.no_grad()
    def put_grad(self, unit: Unit, grad: torch.Tensor, dtype: torch.dtype = torch.float32,
                 last: bool = True) -> torch.Tensor:
        """Start copying ``unit``'s reduced gradient shard (its sum so far) to its host buffer (returned) in
        ``dtype``, which holds it exactly, after taking its sum of squares on the device when it is the
        ``last`` micro-batch's. The caller may drop ``grad`` at once (the copy is ordered on its stream). A
        later call for the same unit (the next micro-batch, another backward) replaces both."""
        if last:
            self._sumsq[unit.name] = kernels.sum_of_squares([grad])
        self.pending.wait_unit(unit.name)  # the last step's update may still read the buffer
        nbytes = grad.numel() * dtype.itemsize
        storage = self._storage.get(unit.name)
        if storage is None or storage.numel() < nbytes:  # bytes for the widest dtype the unit's sums come in
            if storage is not None and self._pinned is not None:
                self._pinned.release(storage)
            storage = self._storage[unit.name] = self.empty(grad.numel() * max(self.grad_bytes, dtype.itemsize),
                                                            torch.uint8)
        buf = self._grads[unit.name] = storage[:nbytes].view(dtype)
        if self.copies is None:
            buf.copy_(grad, non_blocking=True)
            return buf
        compute = torch.cuda.current_stream(self.compute_device)
        self.copies.wait_stream(compute)  # the gradient is made, and the last read of buf (fetch_grad) is done
        with torch.cuda.stream(self.copies):
            buf.copy_(grad, non_blocking=True)
        grad.record_stream(self.copies)  # its memory is reused only once the copy has read it
        done = self._copied[unit.name] = torch.cuda.Event()
        done.record(self.copies)
        self._queued.append(done)
        if len(self._queued) > self.copies_in_flight:
            compute.wait_event(self._queued.popleft())  # bounds the device gradients the queue holds
        return buf

    def fetch_grad(self, unit: Unit, buf: torch.Tensor) -> torch.Tensor:
        """``unit``'s gradient sum so far (``buf``, what :meth:`put_grad` returned) back on the compute device in
        fp32, once its copy out has landed (the next micro-batch adds to it). On a GPU the copy back runs on the
        fetch stream, and the sum of the unit backward reaches next (the one before it in the plan) starts
        coming back at once, so that copy runs beside this unit's backward."""
        if self.copies is None:
            return buf.to(self.compute_device, torch.float32, non_blocking=True)
        fetched = self._fetched.pop(unit.name, None)
        if fetched is None or fetched[0].numel() != buf.numel() or fetched[0].dtype != buf.dtype:
            fetched = self._start_fetch(unit.name, buf)
        out, landed = fetched
        torch.cuda.current_stream(self.compute_device).wait_event(landed)
        before = self._before.get(unit.name)
        if before is not None and before in self._grads and before not in self._fetched:
            self._fetched[before] = self._start_fetch(before, self._grads[before])
        return out.float()

    def _start_fetch(self, name: str, buf: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Copy host ``buf`` (unit ``name``'s) into a new device tensor on the fetch stream, after its copy out."""
        out = torch.empty(buf.numel(), dtype=buf.dtype, device=self.compute_device)
        self.fetches.wait_stream(torch.cuda.current_stream(self.compute_device))  # out's memory is free to write
        done = self._copied.get(name)
        if done is not None:
            self.fetches.wait_event(done)
        with torch.cuda.stream(self.fetches):
            out.copy_(buf, non_blocking=True)
        out.record_stream(self.fetches)
        landed = torch.cuda.Event()
        landed.record(self.fetches)
        return out, landed

    @torch.no_grad()
    def host_grads(self, grads: Mapping[str, torch.Tensor | None]
                   ) -> tuple[dict[str, torch.Tensor | None], torch.Tensor]:
        """Every unit's gradient in host memory (copied now where the reducer did not already) once the copies
        have landed, and the sum of squares of them all, on the compute device."""
        out: dict[str, torch.Tensor | None] = {}
        sums = []
        self._held, self._holding = {}, {}
        self._grad_slots.release_all()  # the last step's update, which read through them, is done
        for name, grad in grads.items():
            if grad is not None and grad is not self._grads.get(name):
                if name in self.resident:  # on the device until the update reads it (held_grad)
                    self._sumsq[name] = kernels.sum_of_squares([grad])
                    self._held[name] = grad
                else:
                    grad = self.put_grad(self.plan.unit(name), grad)
            if grad is not None:
                sums.append(self._sumsq[name])
            out[name] = grad
        self._sumsq = {}
        if self.compute_device.type == "cuda":
            torch.cuda.current_stream(self.compute_device).synchronize()  # the host reads them next
            self.copies.synchronize()
            self._copied, self._queued, self._fetched = {}, collections.deque(), {}
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=self.compute_device)
        return _HostGrads(out, self), total

    def held_grad(self, name: str) -> torch.Tensor:
        """Resident unit ``name``'s final gradient in a host slot, once its copy there has landed; the copy of
        the held unit the update reads next starts now, into the other slot, beside this unit's update."""
        slot, landed = self._holding.pop(name, None) or self._copy_held(name)
        if landed is not None:
            landed.synchronize()
        after = self._held_next.get(name)
        if after in self._held and self._grad_slots.available():
            self._holding[after] = self._copy_held(after)
        return slot

    def _copy_held(self, name: str) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        grad = self._held.pop(name)
        slot, sent = self._grad_slots.take(name, grad.numel(), grad.dtype)
        if self.copies is None:
            return slot.copy_(grad), None
        if sent is not None:
            self.copies.wait_event(sent)  # the shard the update wrote over the slot's last gradient has gone
        with torch.cuda.stream(self.copies):  # host_grads synchronized the stream that made it
            slot.copy_(grad, non_blocking=True)
        grad.record_stream(self.copies)  # its memory is reused only once the copy has read it
        landed = torch.cuda.Event()
        landed.record(self.copies)
        return slot, landed

    def done_with_grad(self, name: str) -> None:
        """The update has read unit ``name``'s gradient, and sent its new shard: a slot it held is free for the next
        held unit, once that copy out of it (:attr:`over_grads`) has landed."""
        self._grad_slots.release(name, after=self._sent.get(name) if self.over_grads else None)

    def resident_bytes(self) -> int:
        """Device bytes of the gradient sums of the :attr:`resident` units, held until the update reads them."""
        return self.grad_bytes * sum(self.plan.shard_size(self.plan.unit(name)) for name in self.resident)

    # -- parameters back ----------------------------------------------------------------------------
    def staging(self, unit: Unit, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """``unit``'s host buffer for its compute-dtype shard, once no copy out of it is in flight (None when
        the compute dtype is fp32: the master itself is sent). With :attr:`over_grads` it is ``grad``, the
        gradient the update has just read for the unit, or else (the copies built outside an update, a skipped
        update's cast) a pageable temporary, dropped once sent. Otherwise, without ``offload_param``, it is the
        next staging slot, which holds the shard until :attr:`staging_slots` more units have been staged."""
        if self.compute_dtype not in _LOWP:
            return None
        if self.over_grads:
            size = self.plan.shard_size(unit)
            fits = grad is not None and grad.dtype == self.compute_dtype and grad.numel() == size
            buf = self._lowp[unit.name] = grad if fits else torch.empty(size, dtype=self.compute_dtype)
            return buf
        if not self.params:
            return self._take_slot(unit)
        buf = self._lowp.get(unit.name)
        if buf is None:
            buf = self._lowp[unit.name] = self.empty(self.plan.shard_size(unit), self.compute_dtype)
        self._wait_sent(unit.name)
        return buf

    def _take_slot(self, unit: Unit) -> torch.Tensor:
        """The slot ``unit`` holds (staged again: a skipped update's cast) or the next one whose shard has gone."""
        with self._slot_lock:
            i = self._slot_of.get(unit.name)
            if i is None:
                i = self._free_slot()
                before, self._owners[i] = self._owners[i], unit.name
                if before is not None:
                    self._wait_sent(before)
                    del self._lowp[before], self._slot_of[before]
                self._slot_of[unit.name] = i
            else:
                self._wait_sent(unit.name)
            self._unsent.add(unit.name)
            buf = self._lowp[unit.name] = self._slots[i][: self.plan.shard_size(unit)]
            return buf

    def _free_slot(self) -> int:
        """A new slot until there are :attr:`staging_slots`, then the next in turn that holds no shard still to be
        sent (a new one if every slot does: never met by a step, which sends each unit before staging the next)."""
        if not self._slots:
            self._largest = max(self.plan.shard_size(u) for u in self.plan.units)
        count = len(self._slots)
        if count >= self.staging_slots:
            for k in range(count):
                i = (self._next_slot + k) % count
                if self._owners[i] not in self._unsent:
                    self._next_slot = (i + 1) % count
                    return i
        self._slots.append(self.empty(self._largest, self.compute_dtype))
        self._owners.append(None)
        return count

    def _wait_sent(self, name: str) -> None:
        sent = self._sent.pop(name, None)
        if sent is not None:
            sent.synchronize()

    def staging_map(self, grads: _HostGrads) -> Mapping[str, torch.Tensor]:
        """The units' staging buffers as a mapping whose reads stage (:meth:`staging`), each unit's when first
        read: the update asks for a unit's just before writing it, after reading its gradient from ``grads``
        (what :meth:`host_grads` returned), so a few slots, or the gradients themselves, serve every unit."""
        return _StagingMap(self, grads)

    @torch.no_grad()
    def stage(self, unit: Unit, src: torch.Tensor) -> torch.Tensor:
        """``unit``'s master shard ``src`` in the compute dtype, in host memory: cast into its host buffer
        (16-bit), or the fp32 master itself."""
        buf = self.staging(unit)
        return src if buf is None else buf.copy_(src)

    def staged(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        """What :meth:`stage` (or the update) last wrote for ``unit`` from its ``master`` shard."""
        if self.compute_dtype not in _LOWP:
            return master
        staged = self._lowp.get(unit.name)
        if staged is None:
            raise RuntimeError(f"unit {unit.name!r}'s staging slot was taken by another unit before its shard was "
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
            self._lowp.pop(unit.name, None)  # temporary goes (a pageable copy has read it when this returns)
        with self._slot_lock:
            self._unsent.discard(unit.name)
        return out

    def host_bytes(self) -> int:
        """Host bytes of the buffers besides the masters and optimizer state: gradient and parameter shards (an
        update that reads every gradient at once, a chain's, takes a gradient slot per resident unit instead)."""
        shards = [self.plan.shard_size(u) for u in self.plan.units]
        lowp = torch.empty((), dtype=self.compute_dtype).element_size() if self.compute_dtype in _LOWP else 0
        staged = sum(shards) if self.params else 0 if self.over_grads else max(shards) * min(self.staging_slots,
                                                                                             len(shards))
        held = [self.plan.shard_size(self.plan.unit(name)) for name in self.resident]
        sent = sum(shards) - sum(held)
        slots = max(held, default=0) * min(_Slots.count, len(held))
        return (sent + slots) * self.grad_bytes + staged * lowp

    def buffers(self) -> list[torch.Tensor]:
        """The host buffers held now besides the masters and optimizer state (what :meth:`host_bytes` counts)."""
        return [*self._storage.values(), *self._grad_slots.buffers,
                *(self._lowp.values() if self.params else self._slots)]


def _resident_units(plan: ShardingPlan, elements: int) -> frozenset[str]:
    """The units whose gradient sums fit in ``elements`` together, taken whole in the order backward reaches
    them (the plan's last first), skipping any too large for what is left."""
    chosen, left = [], elements
    for unit in reversed(plan.units):
        if 0 < plan.shard_size(unit) <= left:
            chosen.append(unit.name)
            left -= plan.shard_size(unit)
    return frozenset(chosen)


class _Slots:
    """Host buffers for the held gradients, reused in turn: one per unit being read, a new one when none is free,
    as large as the largest resident shard in the expected gradient dtype (or the request, if larger)."""

    count = 2  # what the host Adam needs: the unit it updates, and the next one's copy in flight

    def __init__(self, host: HostOffload) -> None:
        self._host = host
        self.free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # a slot, and the copy out to wait for
        self._taken: dict[str, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []

    def take(self, name: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A slot for ``numel`` elements of ``dtype``, and the copy out of it that writing it must wait for."""
        nbytes = numel * dtype.itemsize
        free = next((f for f in self.free if f[0].numel() >= nbytes), None)
        if free is None:
            host = self._host
            largest = max(host.plan.shard_size(host.plan.unit(n)) for n in host.resident)
            slot, sent = host.empty(max(largest * host.grad_bytes, nbytes), torch.uint8), None
            self.buffers.append(slot)
        else:
            self.free.remove(free)
            slot, sent = free
        self._taken[name] = slot
        return slot[:nbytes].view(dtype), sent

    def available(self) -> bool:
        """True when :meth:`take` needs no buffer beyond :attr:`count`."""
        return bool(self.free) or len(self.buffers) < self.count

    def release(self, name: str, after: torch.cuda.Event | None = None) -> None:
        slot = self._taken.pop(name, None)
        if slot is not None:
            self.free.append((slot, after))

    def release_all(self) -> None:
        for name in list(self._taken):
            self.release(name)


class _HostGrads(Mapping):
    """:meth:`HostOffload.host_grads`'s gradients: host buffers, and the held units' read through a slot when
    first asked for (:meth:`HostOffload.held_grad`)."""

    def __init__(self, grads: dict[str, torch.Tensor | None], host: HostOffload) -> None:
        self._grads, self._host = grads, host

    def __getitem__(self, name: str) -> torch.Tensor | None:
        if self._waiting(name):
            self._grads[name] = self._host.held_grad(name)
        return self._grads[name]

    def read(self, name: str) -> torch.Tensor | None:
        """The host gradient handed out for unit ``name``; None while it waits on the device (not yet read)."""
        return None if self._waiting(name) else self._grads.get(name)

    def _waiting(self, name: str) -> bool:
        return name in self._host._held or name in self._host._holding

    def __iter__(self) -> Iterator[str]:
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)


class _StagingMap(Mapping):
    """:meth:`HostOffload.staging_map`: each unit's staging buffer, taken when first read."""

    def __init__(self, host: HostOffload, grads: _HostGrads) -> None:
        self._host, self._grads = host, grads
        self._names = [u.name for u in host.plan.units] if host.compute_dtype in _LOWP else []
        self._taken: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._taken:
            if name not in self._names:
                raise KeyError(name)
            self._taken[name] = self._host.staging(self._host.plan.unit(name), self._grads.read(name))
        return self._taken[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names
