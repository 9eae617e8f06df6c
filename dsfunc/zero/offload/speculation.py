"""The host update ahead of the step: each unit's starts as its gradient lands, checked once the norm is known.

With the optimizer offloaded the host update waited for the global norm and the finite flag, which only the
whole backward gives; SuperOffload (DeepSpeed's "speculation-then-validation") runs it during backward
instead. Here (``offload_optimizer.speculative_update``) the step tells the runner, before its backward, the
update it will apply (:meth:`~dsfunc.zero.offload.runner.HostRunner.expect`); the runner runs that update's
own code with the scalars of a step that is neither clipped nor skipped, which records each unit's
:class:`~dsfunc.optim.update.UnitWork` without running it (:meth:`Speculation.run`). As a unit's final
gradient lands in host memory (:meth:`~dsfunc.zero.offload.grads.HostGrads.put` of the last micro-batch) the
worker thread of the :class:`~dsfunc.zero.offload.executor.HostExecutor` runs the unit's update reading its master
and optimizer state and writing spare host buffers of its own instead (:meth:`UnitWork.ahead`), which leaves the
state as it was. Once the step's scalars are known (:meth:`Speculation.known`) no more updates start ahead: the
units whose update has not begun by then are updated by the step, as without speculation, so a worker that
falls behind backward costs nothing.

[Note: speculation then validation] When the step's update reaches the unit (:meth:`Speculation.settle`) the
speculative update stands if the step's work for the unit is the same (:meth:`UnitWork.same`: the same
tensors, hyper-parameters and bitwise the same step scalars: grad scale, lr, step count, skip flag) and it
read the gradient the update reads now; the update being a deterministic function of exactly those, the
result is bit for bit the non-speculative one. It stands by exchanging the spare buffers with the state's tensors
(``torch.utils.swap_tensors``: every holder of the state sees the new values; the old ones are the next step's
spares), or, where a view of a state tensor is held elsewhere, by copying the new values in. Otherwise (the step clipped: its grad scale differs; it overflowed: skip; an lr given by the client) the
spare buffers are dropped, which undoes it, and the unit is updated as without speculation. A second gradient for
a unit already updated (:meth:`Speculation.release`) undoes it the same way, and a step that ends before its
update (an error in backward) is undone by the next :meth:`Speculation.expect`.

Cost: host memory for the spare buffers, 12 bytes a parameter for Adam (fp32 master and two moments; 6 with bf16
masters and moments, 8 with Kahan's compensation too), kept between steps; no host traffic beyond the update's
own (nothing is copied aside before it or back after it); on a clipped or skipped step the update again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future

import torch

from dsfunc.optim.update import UnitWork
from dsfunc.zero.offload.executor import HostExecutor


class Speculation:
    """Each unit's expected update, run as its gradient lands into spare buffers, exchanged in when it stands."""

    on_host = True  # the expected update runs with this as its executor (it records, runs nothing)

    def __init__(self, executor: HostExecutor, *, wait_start: bool, elements: int | None = None) -> None:
        self._executor = executor
        # None: every unit runs ahead; else the elements of those that may, whole units as they first land
        self._elements = elements
        self._sizes: dict[str, int] = {}  # unit -> its elements, of the units admitted within that budget
        # the compute device is the CPU: put() returns once the unit's update has begun (host and device share the
        # cores, so nothing is lost, and the order of the log is the same every run)
        self._wait_start = wait_start
        self.grads: dict[str, torch.Tensor] = {}  # unit -> the gradient its speculative update read
        self._work: dict[str, UnitWork] = {}  # unit -> the expected update's work over it (until the norm is known)
        self._jobs: dict[str, tuple[Future, UnitWork]] = {}  # unit -> its speculative update, until settled
        self._spare: dict[str, list[torch.Tensor]] = {}  # unit -> buffers like what its update writes (kept)
        # what happened when: ("landed", unit) as a gradient lands, ("start", unit) as its update begins, ("known", "")
        # once the step's scalars are
        self.log: list[tuple[str, str]] = []
        self.stood: set[str] = set()  # this step's units whose speculative update stood
        self.undone: set[str] = set()  # this step's units whose speculative update was undone
        self.late: set[str] = set()  # this step's units whose update had not begun when the scalars were known

    def expect(self, apply: Callable[[Mapping[str, torch.Tensor]], None]) -> None:
        """A new step: ``apply(grads)`` runs its expected update with this as executor, reading ``grads``."""
        for name in list(self._jobs):  # a step that ended before its update: undone
            self.release(name)
        self.grads, self._work, self.log = {}, {}, []
        self.stood, self.undone, self.late = set(), set(), set()
        apply(self.grads)

    def run(self, names: list[str], work: UnitWork) -> None:
        """The expected update's work over ``names``: kept, to run unit by unit as each gradient lands."""
        for name in names:
            self._work[name] = work

    def unit_done(self, name: str, master: torch.Tensor) -> None:
        """Nothing is sent of a speculative update: the unit's new shard goes once the update stands."""

    def landed(self, name: str, grad: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        """Unit ``name``'s final gradient is ``grad`` in host memory (once ``copied`` has completed): its expected
        update starts in the worker."""
        work = self._work.get(name)
        if work is None or not self._admits(name, grad.numel()):
            return
        self.grads[name] = grad
        self.log.append(("landed", name))
        started = threading.Event()

        def update() -> None:
            started.set()
            self.log.append(("start", name))
            if copied is not None:
                copied.synchronize()
            spare = self._spare.get(name)
            if spare is None:
                spare = self._spare[name] = [torch.empty_like(t) for t in work.writes(name)]
            work.ahead(name, spare)

        self._jobs[name] = (self._executor.submit(update), work)
        if self._wait_start:
            started.wait()

    def _admits(self, name: str, elements: int) -> bool:
        """Whether unit ``name`` (``elements`` of gradient) runs ahead: within the budget of elements."""
        if self._elements is not None and name not in self._sizes:
            if sum(self._sizes.values()) + elements > self._elements:
                return False
            self._sizes[name] = elements
        return True

    def known(self) -> None:
        """The step's scalars are known: no update starts ahead of it any more; those not yet begun are the step's."""
        self.log.append(("known", ""))
        self._work = {}
        for name, (future, _) in list(self._jobs.items()):
            if future.cancel():
                del self._jobs[name]
                self.late.add(name)

    def release(self, name: str) -> None:
        """Unit ``name``'s gradient buffer is about to be written again: its speculative update, if any, is undone."""
        job = self._jobs.pop(name, None)
        if job is not None:
            job[0].result()
            self.undone.add(name)

    def settle(self, names: list[str], work: UnitWork, grads: Mapping[str, torch.Tensor | None]) -> list[str]:
        """The units of ``names`` whose speculative update stands for the step's ``work`` reading ``grads``
        (see the note above), exchanged into the state; the others' is undone."""
        stood = []
        for name in names:
            job = self._jobs.pop(name, None)
            if job is None:
                continue
            future, expected = job
            future.result()
            if expected.same(work, name) and grads.get(name) is self.grads.get(name):
                for live, new in zip(work.writes(name), self._spare[name], strict=True):
                    _exchange(live, new)
                stood.append(name)
                self.stood.add(name)
            else:
                self.undone.add(name)
        return stood

    def host_bytes(self) -> int:
        """Host bytes of the spare buffers."""
        return sum(t.numel() * t.element_size() for spare in self._spare.values() for t in spare)

    def buffers(self) -> list[torch.Tensor]:
        """The spare buffers held now."""
        return [t for spare in self._spare.values() for t in spare]


def _exchange(live: torch.Tensor, new: torch.Tensor) -> None:
    """``live`` takes ``new``'s values, every holder of it included; ``new`` the old ones (the next spare). Where
    nothing else holds either tensor their contents are swapped; where something does (a view of a master kept
    across steps, say) the values are copied in, as an update in place writes them."""
    if live._use_count() == 1 and new._use_count() == 1:
        torch.utils.swap_tensors(live, new)
    else:
        live.copy_(new)
