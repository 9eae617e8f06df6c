"""Gradient reduction: what happens to a unit's gradient when backward produces it.

The micro-batch runtime hands each unit's gradient to a reducer from the gradient hook, as backward
produces it. :class:`LocalReducer` sums this process's gradients (no collective; what a gradient
function without :func:`dsfunc.shard` gets). :class:`ZeroReducer` reduces over the data-parallel ranks as
the ZeRO stage says:

* stage 0: all-reduce of the full gradient, in chunks of ``reduce_bucket_size`` elements;
* stage 1: local fp32 accumulation over micro-batches, one reduce-scatter per unit on the last one;
* stages 2-3: a reduce-scatter per unit per micro-batch, only this rank's shard kept.

A unit with a group of its own (an expert's expert-data-parallel ranks, :mod:`dsfunc.experts`) is reduced over
that group, and sharded over it at stages 1-3 (:meth:`~dsfunc.zero.layout.ShardingPlan.group_of`).

Reductions are issued asynchronously, so communication overlaps the rest of backward; at most two are
in flight (each holds a full-size gradient until it finishes). Every collective is a SUM: the runtime
folds the 1/world factor of the mean into the backward seed.

A reduced gradient is kept in the narrowest dtype that holds it exactly (:func:`grad_dtype`): the backward's
bf16 for one micro-batch on one rank (2 bytes per parameter, not 4), fp32 once micro-batches or ranks are
summed in fp32 (bf16 with ``bf16_master_weights_and_grads``: :func:`sum_dtype`). Host buffers always are; on
the device only when the update reads 16-bit gradients itself (``narrow``: the fused Adam reads them as they
are, element by element), since a transform chain would widen every unit at once and hold both.

Where a unit's sum waits between micro-batches is the run's :class:`~dsfunc.zero.policy.GradStore`'s to say:
on the device by default. One that takes sums off the device (ZeRO-Offload: :mod:`dsfunc.zero.offload.grads`)
gets each unit's shard as each of its reductions lands, to start its copy away while backward goes on, and the
device copy is dropped; :meth:`ZeroReducer.finish` then returns what it stored. With gradient accumulation at
stages 2-3 the next micro-batch's reduction takes the stored sum back to the device, adds to it and stores it
again (stream-ordered copies; DeepSpeed accumulates offloaded stage-2 gradients the same way), so no gradient
shard waits on the device between micro-batches, but those of the units the store says stay
(:meth:`~dsfunc.zero.policy.GradStore.stays`). A first micro-batch's shard is stored in its exact dtype (bf16 on
one rank) and comes back widened: the same sum, with 4 of the 60 bytes a parameter that 8 micro-batches move
over PCIe saved. A gradient added with ``followed`` (the next micro-batch's of the same unit comes right after
it: :mod:`dsfunc.zero.backward_by_units`) keeps its sum on the device for that one, so the sum crosses PCIe once
for the micro-batches a backward goes through together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dsfunc.config import Config
from dsfunc.distributed import comm
from dsfunc.zero.layout import ShardingPlan, Unit
from dsfunc.zero.policy import DeviceGrads, GradStore

Grads = dict[str, torch.Tensor | None]


def exact_dtype(dtype: torch.dtype, comm_dtype: torch.dtype, ranks: int) -> torch.dtype:
    """The narrowest dtype that holds exactly a reduced gradient made of one micro-batch's gradient of ``dtype``,
    summed over ``ranks``: the collective's output dtype over several ranks; on one rank the reduction is the
    identity, so the gradient as rounded to ``comm_dtype``."""
    if ranks > 1 or dtype in (comm_dtype, torch.float32):
        return comm_dtype
    return dtype if comm_dtype == torch.float32 else torch.float32


def sum_dtype(config: Config) -> torch.dtype:
    """What gradient sums are held in: bf16 with ``bf16.bf16_master_weights_and_grads`` (DeepSpeed's bf16 gradients:
    each micro-batch's sum, and the reduced one, rounded to nearest into bf16), else fp32."""
    return torch.bfloat16 if config.bf16.bf16_master_weights_and_grads else torch.float32


def grad_dtype(compute_dtype: torch.dtype, comm_dtype: torch.dtype, ranks: int, micro_batches: int,
               sums: torch.dtype = torch.float32) -> torch.dtype:
    """What a reduced gradient is held in at the end of a step (:meth:`ZeroReducer._store`), on the device or in an
    offloaded host buffer: bf16 sums (:func:`sum_dtype`) always, else the :func:`exact_dtype` of one micro-batch,
    fp32 once micro-batches are summed."""
    if sums != torch.float32:
        return sums
    return exact_dtype(compute_dtype, comm_dtype, ranks) if micro_batches == 1 else torch.float32


def _accumulate(sums: dict[str, torch.Tensor], name: str, grad: torch.Tensor, *, keep: bool = False,
                dtype: torch.dtype = torch.float32) -> None:
    """``sums[name] += grad``, added in fp32 and held in ``dtype`` (bf16 sums: rounded once per addition, as a
    bf16 ``add_`` does); a first gradient is kept in its own dtype when ``keep`` (no more will be added but
    another backward's, which widens the sum then)."""
    prev = sums.get(name)
    if prev is None:
        sums[name] = grad if keep else grad.to(dtype)
    else:
        sums[name] = prev.float().add_(grad).to(dtype)


class Reducer(Protocol):
    """What the runtime hands gradients to (:mod:`dsfunc.zero.reduce`)."""

    streams: bool  # it wants each unit's gradient as backward makes it (see [Note: gradients as they come])

    def add(self, unit: Unit, grad: torch.Tensor, *, last: bool, followed: bool = False) -> None: ...
    def end_micro(self, *, last: bool) -> None: ...
    def finish(self) -> Grads: ...


class LocalReducer:
    """This process's gradients, summed in ``sums`` (fp32 or bf16) over micro-batches (one micro-batch's kept as
    is if ``narrow``)."""

    streams = False  # nothing to start while backward runs: the gradients may come after it

    def __init__(self, plan: ShardingPlan, *, narrow: bool = False, sums: torch.dtype = torch.float32) -> None:
        self.plan = plan
        self.narrow = narrow
        self.sums = sums
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, unit: Unit, grad: torch.Tensor, *, last: bool, followed: bool = False) -> None:
        """Add ``unit``'s gradient of a micro-batch (the sums stay here: ``followed`` changes nothing)."""
        _accumulate(self._sums, unit.name, grad, keep=last and self.narrow, dtype=self.sums)

    def end_micro(self, *, last: bool) -> None:
        """Nothing to flush: the sums stay local."""

    def finish(self) -> Grads:
        """Gradients by unit; ``None`` for a unit no loss reached."""
        out: Grads = {u.name: self._sums.get(u.name) for u in self.plan.units}
        self._sums = {}
        return out


class ZeroReducer:
    """Gradients reduced over ranks into this rank's shard (the full gradient at stage 0)."""

    max_in_flight = 2  # reductions in flight during backward; older ones are waited for as new ones start

    def __init__(self, plan: ShardingPlan, *, comm_dtype: torch.dtype, bucket_size: int,
                 device: torch.device, store: GradStore | None = None, narrow: bool = False,
                 sums: torch.dtype = torch.float32) -> None:
        self.plan = plan
        self.sums = sums  # what the sums are held in (fp32, or bf16: sum_dtype)
        self.store = DeviceGrads(device) if store is None else store  # where sums wait between micro-batches
        # whether a gradient should come as soon as backward makes it: its collective, or its copy off the device,
        # then runs beside the rest of backward (on one rank with every sum on the device they may come after it)
        self.streams = plan.world_size > 1 or self.store.off_device
        self.narrow = narrow or self.store.off_device  # a gradient kept in its exact dtype (a stored one always is)
        self.comm_dtype = comm_dtype
        self.bucket_size = bucket_size
        self.device = device
        self._local: dict[str, torch.Tensor] = {}  # stages 0-1: sums of the micro-batches before the last
        self._in_flight: list[tuple[comm.InFlight, Callable[[], None]]] = []
        self._reduced: set[str] = set()  # units reduced in this micro-batch
        self._grads: dict[str, torch.Tensor] = {}
        self._stored: dict[str, torch.Tensor] = {}  # unit -> what the store returned for its sum so far

    def add(self, unit: Unit, grad: torch.Tensor, *, last: bool, followed: bool = False) -> None:
        """Reduce ``unit``'s gradient of a micro-batch into its sum (``last``: of the step's last micro-batch;
        ``followed``: the unit's next gradient comes next, so its sum stays on the device for it)."""
        self._reduced.add(unit.name)
        stage = self.plan.stage
        if stage <= 1 and not last:
            _accumulate(self._local, unit.name, grad, dtype=self.sums)  # one reduction after the last micro-batch
            return
        local = self._local.pop(unit.name, None) if stage <= 1 else None
        exact = exact_dtype(grad.dtype, self.comm_dtype, self.plan.world_size) if local is None else torch.float32
        # On one rank the collective is the identity: a gradient already in the dtype it is kept in is not copied.
        alone = self.plan.world_size == 1 and local is None and exact == grad.dtype
        full = grad if alone else grad.to(self.comm_dtype)
        if local is not None:
            full = full + local.to(self.comm_dtype)
        if self.plan.world_size == 1:  # no collective to issue or wait for: stored as it comes
            self._store(unit, full, last, exact, followed)
        elif stage == 0:
            chunks = full.split(self.bucket_size)
            group = self.plan.group_of(unit)
            for chunk in chunks[:-1]:
                self._in_flight.append((comm.all_reduce_sum(chunk, group, async_op=True), lambda: None))
            work = comm.all_reduce_sum(chunks[-1], group, async_op=True)
            self._in_flight.append((work, lambda u=unit, t=full: self._store(u, t, last, exact, followed)))
        else:
            out = torch.empty(self.plan.shard_size(unit), dtype=full.dtype, device=full.device)
            work = comm.reduce_scatter_sum(out, full, self.plan.group_of(unit), async_op=True)
            self._in_flight.append((work, lambda u=unit, t=out, keep=full: self._store(u, t, last, exact, followed)))
        self._drain(keep=self.max_in_flight)

    def end_micro(self, *, last: bool) -> None:
        """Units no loss reached still join the collectives (every rank issues the same ones)."""
        for unit in self.plan.units:
            if unit.name not in self._reduced:
                length = self.plan.padded_size(unit) if self.plan.stage >= 1 else unit.numel
                self.add(unit, torch.zeros(length, device=self.device), last=last)
        self._reduced = set()
        if self.plan.stage >= 2:
            self._drain()
        # a sum kept for a next gradient that did not come goes where it would have
        for name in [n for n in self._grads if not self.store.stays(n)]:
            total = self._grads.pop(name)
            self._stored[name] = self.store.put(self.plan.unit(name), total, total.dtype, last)

    def finish(self) -> Grads:
        """This rank's reduced gradients by unit (each in its :func:`grad_dtype`), after the last micro-batch."""
        self._drain()
        grads: Grads = {**self._grads, **self._stored}
        self._grads, self._stored = {}, {}
        return grads

    def so_far(self, unit: Unit, copy: bool = False) -> tuple[torch.Tensor | None, bool]:
        """``unit``'s gradient of the step so far, ending nothing: ``(its reduced sum, True)`` once a reduction
        of it ran (this rank's shard at stages 1-3), else ``(this rank's own sum, False)`` (stages 0-1 before the
        last micro-batch), ``(None, False)`` before any. The in-flight reductions are waited for. A sum gone to
        the host (offload_optimizer) comes back on the device: a copy to read when ``copy``, else to write, kept
        there as a sum that stays (:meth:`finish` hands it to the store, which takes its norm then, as any)."""
        self._drain()
        if unit.name in self._stored:
            if copy:
                return self.store.take(unit, self._stored[unit.name]), True
            # cloned: on a CPU ``take`` may hand back the host buffer itself, which finish would then not store anew
            self._grads[unit.name] = self.store.take(unit, self._stored.pop(unit.name)).clone()
        if unit.name in self._grads:
            return self._grads[unit.name], True
        return self._local.get(unit.name), False

    def _store(self, unit: Unit, reduced: torch.Tensor, last: bool, exact: torch.dtype, followed: bool) -> None:
        prev = self._grads.pop(unit.name, None)
        if prev is None and unit.name in self._stored:  # an earlier micro-batch's (or backward's) sum, stored away
            prev = self.store.take(unit, self._stored.pop(unit.name))
        kept = self.store.stays(unit.name) or followed
        if prev is not None:
            reduced = prev.float().add_(reduced).to(self.sums)
        elif self.sums != torch.float32:  # bf16 sums: the reduced gradient rounded into them
            reduced = reduced.to(self.sums)
        else:  # its exact dtype after the last micro-batch if kept narrow, or on its way to the host (where the
            # next micro-batch's take widens it): half the bytes each way; fp32 if more will be added here
            reduced = reduced.to(exact if (last and self.narrow) or not kept else torch.float32)
        if kept:
            self._grads[unit.name] = reduced
        else:
            self._stored[unit.name] = self.store.put(unit, reduced, reduced.dtype, last)

    def _drain(self, keep: int = 0) -> None:
        """Finish all but the ``keep`` newest reductions (their full-size inputs are then freed)."""
        while len(self._in_flight) > keep:
            work, then = self._in_flight.pop(0)
            work.wait()
            then()
