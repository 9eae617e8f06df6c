"""Gradient sums the host CPU adds up between micro-batches (ZeRO-Offload with gradient accumulation).

With the optimizer offloaded a unit's fp32 gradient sum lives in host memory, and by default each
micro-batch brings it back to the device, adds the new gradient there and sends it out again: 8 bytes a
parameter over PCIe per micro-batch, which bounds the step at 6B parameters on one H200 (bench/RESULTS.md).
For the units in ``offload_optimizer.grad_accumulation_on_host`` the micro-batches between the first and
the last send only their gradient (2 bytes a parameter in bf16) and a worker thread adds it into the host
sum (:meth:`HostSums.add`), while backward goes on: the host's memory bandwidth takes the PCIe's place.
The last micro-batch still adds on the device, as before, after :meth:`HostSums.wait`: so the global norm is
taken there, and every sum is the same IEEE fp32 addition of the same numbers in the same order as on the
device, bit for bit.

Each gradient passes through one of a few pinned staging buffers of the largest unit's size, reused once the
worker has added it (:attr:`HostSums.staging_slots`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class HostSums:
    """The host's adds of gradients into fp32 sums, one worker thread, a few staging buffers."""

    staging_slots = 3  # at most, for as many units
    chunk = 1 << 22  # elements widened at a time: 16 MB of fp32 scratch, which stays in cache

    def __init__(self, empty: Callable[[int, torch.dtype], torch.Tensor], slot_bytes: int, slots: int) -> None:
        self._empty = empty  # a host buffer for copies with the device (pinned there)
        self.slot_bytes = slot_bytes  # each staging buffer's: the largest gradient it takes
        self.slots = slots  # how many staging buffers, made at the first add
        self._slots: list[torch.Tensor] = []
        self._free: collections.deque[int] = collections.deque()
        self._lock = threading.Condition()
        self._pending: dict[str, int] = collections.Counter()  # unit -> adds queued and not yet done
        self._executor: ThreadPoolExecutor | None = None
        self._adds: collections.deque[Future] = collections.deque()  # the worker's, a failed one raised at the next
        self._scratch: torch.Tensor | None = None  # the worker's, for 16-bit gradients
        self._threads = max(1, torch.get_num_threads() - 1)  # one core stays with the thread that launches kernels

    def slot(self, numel: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A free staging buffer for ``numel`` elements of ``dtype``, waiting for the worker to free one if none is."""
        with self._lock:
            if not self._slots:
                self._slots = [self._empty(self.slot_bytes, torch.uint8) for _ in range(self.slots)]
                self._free.extend(range(self.slots))
            while not self._free:
                self._lock.wait()
            i = self._free.popleft()
        buf = self._slots[i]
        if buf.numel() < numel * dtype.itemsize:
            raise RuntimeError(f"a host staging buffer of {buf.numel()} bytes cannot hold {numel} {dtype} elements "
                               "(a dsfunc bug: the buffers are sized by the largest unit; please report it)")
        return i, buf[: numel * dtype.itemsize].view(dtype)

    def add(self, name: str, into: torch.Tensor, slot: int, grad: torch.Tensor,
            landed: list[torch.cuda.Event | None], *, widen: bool = False) -> None:
        """Queue ``into += grad`` (``into[:] = grad`` if ``widen``) for the worker (``grad``: a view of staging
        buffer ``slot``), once each of ``landed`` (the copies into both) has completed; the slot is free again
        after it."""
        self._raise()
        with self._lock:
            self._pending[name] += 1
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsfunc-host-sums")
        self._adds.append(self._executor.submit(self._add, name, into, slot, grad, landed, widen))

    def _add(self, name: str, into: torch.Tensor, slot: int, grad: torch.Tensor,
             landed: list[torch.cuda.Event | None], widen: bool) -> None:
        try:
            torch.set_num_threads(self._threads)
            for event in landed:
                if event is not None:
                    event.synchronize()
            with torch.no_grad():
                into.copy_(grad) if widen else self._add_widened(into, grad)
        finally:
            with self._lock:
                self._free.append(slot)
                self._pending[name] -= 1
                self._lock.notify_all()

    def _add_widened(self, into: torch.Tensor, grad: torch.Tensor) -> None:
        """``into += grad`` a chunk at a time through an fp32 scratch buffer when ``grad`` is 16-bit: torch's CPU
        add of mixed dtypes is not vectorized (2 G elements/s on the H200 machine's 15 threads, where widening
        copies and fp32 adds run at 9-10). The same fp32 additions: widening is exact."""
        if grad.dtype == into.dtype:
            into.add_(grad)
            return
        if self._scratch is None:
            self._scratch = torch.empty(self.chunk, dtype=into.dtype)
        for start in range(0, grad.numel(), self.chunk):
            part = grad[start : start + self.chunk]
            wide = self._scratch[: part.numel()].copy_(part)
            into[start : start + part.numel()].add_(wide)

    def wait(self, name: str | None = None) -> None:
        """Return once every queued add into unit ``name``'s sum (every unit's: None) is done."""
        with self._lock:
            while self._pending[name] if name is not None else any(self._pending.values()):
                self._lock.wait()
        self._raise()

    def _raise(self) -> None:
        """Raise what a finished add raised, in the caller's thread."""
        while self._adds and self._adds[0].done():
            self._adds.popleft().result()

    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers held now."""
        return list(self._slots)
