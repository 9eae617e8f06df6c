"""Gradient reduction: what happens to a unit's gradient when backward produces it.

The micro-batch runtime hands each unit's gradient to a reducer from the gradient hook, as backward
produces it. :class:`LocalReducer` sums this process's gradients (no collective; what a gradient
function without :func:`dsfunc.shard` gets). :class:`ZeroReducer` reduces over the data-parallel ranks as
the ZeRO stage says:

* stage 0: all-reduce of the full gradient, in chunks of ``reduce_bucket_size`` elements (over the unit's own
  group when it has one: an expert's, :mod:`dsfunc.experts`);
* stage 1: local fp32 accumulation over micro-batches, one reduce-scatter per unit on the last one;
* stages 2-3: a reduce-scatter per unit per micro-batch, only this rank's shard kept.

Reductions are issued asynchronously, so communication overlaps the rest of backward; at most two are
in flight (each holds a full-size gradient until it finishes). Every collective is a SUM: the runtime
folds the 1/world factor of the mean into the backward seed.

A reduced gradient is kept in the narrowest dtype that holds it exactly (:func:`grad_dtype`): the backward's
bf16 for one micro-batch on one rank (2 bytes per parameter, not 4), fp32 once micro-batches or ranks are
summed in fp32. Host buffers always are; on the device only when the update reads 16-bit gradients itself
(``narrow``: the fused Adam reads them as they are, element by element), since a transform chain would widen
every unit at once and hold both.

With the optimizer offloaded, a ``sink`` (:meth:`dsfunc.zero.offload.HostOffload.put_grad`) takes each
unit's shard as each of its reductions lands, to start its copy to host memory while backward goes on,
and the device copy is dropped; :meth:`ZeroReducer.finish` then returns the host copies. With gradient
accumulation at stages 2-3 the next micro-batch's reduction brings the host sum back to the device, adds
to it and sends it out again (stream-ordered copies; DeepSpeed accumulates offloaded stage-2 gradients the
same way), so no gradient shard waits on the device between micro-batches, but those of the ``resident``
units (``offload_optimizer.grad_accumulation_on_device``), whose sums never go to the sink: they wait on the
device until the update reads them (:meth:`dsfunc.zero.offload.HostOffload.held_grad`). A first
micro-batch's shard goes out in its exact dtype (bf16 on one rank) and comes back widened: the same sum, with
4 of the 60 bytes a parameter that 8 micro-batches move over PCIe saved. A gradient added with ``hold`` (the
next micro-batch's of the same unit comes right after it: :mod:`dsfunc.zero.backward_by_units`) keeps its sum
on the device for that one, so the sum crosses PCIe once for the micro-batches a backward goes through together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dsfunc.distributed import comm
from dsfunc.errors import InputError
from dsfunc.zero.layout import ShardingPlan, Unit

Grads = dict[str, torch.Tensor | None]
Sink = Callable[[Unit, torch.Tensor, torch.dtype, bool], torch.Tensor]
Fetch = Callable[[Unit, torch.Tensor], torch.Tensor]  # a sunk sum back on the device, in fp32


def exact_dtype(dtype: torch.dtype, comm_dtype: torch.dtype, ranks: int) -> torch.dtype:
    """The narrowest dtype that holds exactly a reduced gradient made of one micro-batch's gradient of ``dtype``,
    summed over ``ranks``: the collective's output dtype over several ranks; on one rank the reduction is the
    identity, so the gradient as rounded to ``comm_dtype``."""
    if ranks > 1 or dtype in (comm_dtype, torch.float32):
        return comm_dtype
    return dtype if comm_dtype == torch.float32 else torch.float32


def grad_dtype(compute_dtype: torch.dtype, comm_dtype: torch.dtype, ranks: int, micro_batches: int) -> torch.dtype:
    """What a reduced gradient is held in at the end of a step (:meth:`ZeroReducer._store`), on the device or in an
    offloaded host buffer: the :func:`exact_dtype` of one micro-batch, fp32 once micro-batches are summed."""
    return exact_dtype(compute_dtype, comm_dtype, ranks) if micro_batches == 1 else torch.float32


def _accumulate(sums: dict[str, torch.Tensor], name: str, grad: torch.Tensor, *, keep: bool = False) -> None:
    """``sums[name] += grad`` in fp32; a first gradient is kept in its own dtype when ``keep`` (no more will be
    added but another backward's, which widens the sum then)."""
    prev = sums.get(name)
    sums[name] = (grad if keep else grad.float()) if prev is None else prev.float().add_(grad)


class Reducer(Protocol):
    """What the runtime hands gradients to (:mod:`dsfunc.zero.reduce`)."""

    streams: bool  # it wants each unit's gradient as backward makes it (see [Note: gradients as they come])

    def add(self, unit: Unit, grad: torch.Tensor, *, last: bool, hold: bool = False) -> None: ...
    def end_micro(self, *, last: bool) -> None: ...
    def finish(self) -> Grads: ...


class LocalReducer:
    """This process's gradients, summed in fp32 over micro-batches (one micro-batch's kept as is if ``narrow``)."""

    streams = False  # nothing to start while backward runs: the gradients may come after it

    def __init__(self, plan: ShardingPlan, *, narrow: bool = False) -> None:
        self.plan = plan
        self.narrow = narrow
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, unit: Unit, grad: torch.Tensor, *, last: bool, hold: bool = False) -> None:
        """Add ``unit``'s gradient of a micro-batch (the sums stay here: ``hold`` changes nothing)."""
        _accumulate(self._sums, unit.name, grad, keep=last and self.narrow)

    def end_micro(self, *, last: bool) -> None:
        """Nothing to flush: the sums stay local."""

    def finish(self) -> Grads:
        """Gradients by unit; ``None`` for a unit no loss reached."""
        out: Grads = {u.name: self._sums.get(u.name) for u in self.plan.units}
        self._sums = {}
        return out


class ZeroReducer:
    """Gradients reduced over ranks into this rank's shard (the full gradient at stage 0)."""

    max_inflight = 2  # reductions in flight during backward; older ones are waited for as new ones start

    def __init__(self, plan: ShardingPlan, *, comm_dtype: torch.dtype, bucket_size: int,
                 device: torch.device, sink: Sink | None = None, fetch: Fetch | None = None,
                 resident: frozenset[str] = frozenset(), narrow: bool = False) -> None:
        self.plan = plan
        self.sink = sink
        self.resident = resident  # with a sink: units whose sums stay here until the last micro-batch
        # whether a gradient should come as soon as backward makes it: its collective, or its copy to the host,
        # then runs beside the rest of backward (on one rank without a sink they may come after it)
        self.streams = plan.world_size > 1 or sink is not None
        self.fetch = fetch or (lambda _unit, t: t.to(device, torch.float32, non_blocking=True))
        self.narrow = narrow or sink is not None  # a gradient kept in its exact dtype (a sunk one always is)
        self.comm_dtype = comm_dtype
        self.bucket_size = bucket_size
        self.device = device
        self._local: dict[str, torch.Tensor] = {}  # stages 0-1: sums of the micro-batches before the last
        self._pending: list[tuple[comm.Pending, Callable[[], None]]] = []
        self._reduced: set[str] = set()  # units reduced in this micro-batch
        self._grads: dict[str, torch.Tensor] = {}
        self._sunk: dict[str, torch.Tensor] = {}  # unit -> what the sink returned for its sum so far

    def add(self, unit: Unit, grad: torch.Tensor, *, last: bool, hold: bool = False) -> None:
        """Reduce ``unit``'s gradient of a micro-batch into its sum (``last``: of the step's last micro-batch;
        ``hold``: the unit's next gradient comes next, so its sum stays on the device for it)."""
        self._reduced.add(unit.name)
        stage = self.plan.stage
        if stage <= 1 and not last:
            _accumulate(self._local, unit.name, grad)  # one reduction after the last micro-batch
            return
        local = self._local.pop(unit.name, None) if stage <= 1 else None
        exact = exact_dtype(grad.dtype, self.comm_dtype, self.plan.world_size) if local is None else torch.float32
        # On one rank the collective is the identity: a gradient already in the dtype it is kept in is not copied.
        alone = self.plan.world_size == 1 and local is None and exact == grad.dtype
        full = grad if alone else grad.to(self.comm_dtype)
        if local is not None:
            full = full + local.to(self.comm_dtype)
        if self.plan.world_size == 1:  # no collective to issue or wait for: stored as it comes
            self._store(unit, full, last, exact, hold)
        elif stage == 0:
            chunks = full.split(self.bucket_size)
            with comm.over(unit.group):  # an expert's: over its expert-data-parallel ranks
                for chunk in chunks[:-1]:
                    self._pending.append((comm.all_reduce_sum(chunk, async_op=True), lambda: None))
                work = comm.all_reduce_sum(chunks[-1], async_op=True)
            self._pending.append((work, lambda u=unit, t=full: self._store(u, t, last, exact, hold)))
        else:
            out = torch.empty(self.plan.shard_size(unit), dtype=full.dtype, device=full.device)
            work = comm.reduce_scatter_sum(out, full, async_op=True)
            self._pending.append((work, lambda u=unit, t=out, keep=full: self._store(u, t, last, exact, hold)))
        self._drain(keep=self.max_inflight)

    def end_micro(self, *, last: bool) -> None:
        """Units no loss reached still join the collectives (every rank issues the same ones)."""
        for unit in self.plan.units:
            if unit.name not in self._reduced:
                length = self.plan.padded_size(unit) if self.plan.stage >= 1 else unit.numel
                self.add(unit, torch.zeros(length, device=self.device), last=last)
        self._reduced = set()
        if self.plan.stage >= 2:
            self._drain()
        if self.sink is not None:  # a sum held for a next gradient that did not come goes where it would have
            for name in [n for n in self._grads if n not in self.resident]:
                total = self._grads.pop(name)
                self._sunk[name] = self.sink(self.plan.unit(name), total, total.dtype, last)

    def finish(self) -> Grads:
        """This rank's reduced gradients by unit (each in its :func:`grad_dtype`), after the last micro-batch."""
        self._drain()
        grads: Grads = {**self._grads, **self._sunk}
        self._grads, self._sunk = {}, {}
        return grads

    def so_far(self, unit: Unit) -> tuple[torch.Tensor | None, bool]:
        """``unit``'s gradient of the step so far, ending nothing: ``(its reduced sum, True)`` once a reduction
        of it ran (this rank's shard at stages 1-3), else ``(this rank's own sum, False)`` (stages 0-1 before the
        last micro-batch), ``(None, False)`` before any. The in-flight reductions are waited for."""
        self._drain()
        if unit.name in self._sunk:
            raise InputError("the step's gradients are on their way to the host (offload_optimizer); read them "
                             "without offloading")
        if unit.name in self._grads:
            return self._grads[unit.name], True
        return self._local.get(unit.name), False

    def _store(self, unit: Unit, reduced: torch.Tensor, last: bool, exact: torch.dtype, hold: bool) -> None:
        prev = self._grads.pop(unit.name, None)
        if prev is None and unit.name in self._sunk:  # an earlier micro-batch's (or backward's) sum, on the host
            prev = self.fetch(unit, self._sunk.pop(unit.name))
        kept = self.sink is None or unit.name in self.resident or hold
        if prev is not None:
            reduced = prev.float().add_(reduced)
        else:  # its exact dtype after the last micro-batch if kept narrow, or on its way to the host (where the
            # next micro-batch's fetch widens it): half the bytes each way; fp32 if more will be added here
            reduced = reduced.to(exact if (last and self.narrow) or not kept else torch.float32)
        if kept:
            self._grads[unit.name] = reduced
        else:
            self._sunk[unit.name] = self.sink(unit, reduced, reduced.dtype, last)

    def _drain(self, keep: int = 0) -> None:
        """Finish all but the ``keep`` newest reductions (their full-size inputs are then freed)."""
        while len(self._pending) > keep:
            work, store = self._pending.pop(0)
            work.wait()
            store()
