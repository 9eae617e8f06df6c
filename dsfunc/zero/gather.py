"""The compute copies of the parameters that forward and backward read, and ZeRO-3's gather and free.

A :class:`Workspace` is the one mutable object of a run (owned by its :class:`~dsfunc.init.Program`,
shared by every state of the run). It caches what is derived from the fp32 masters and never
checkpointed: the compute-dtype copy of each unit, and at stage 3 the gathered buffers and their
all-gathers in flight. It also points at the micro-batch runtime that is bound right now
(:attr:`Workspace.active`), which the stage-3 module hooks call.

Persistent units (stages 0-2, and stage-3 units below ``stage3_param_persistence_threshold``) keep a
full copy, rebuilt after every update. Lazy units (stage 3) are all-gathered on demand into a buffer
whose storage is freed after use; autograd's saved views of the buffer see the refill.

Where a copy's shard comes from is the run's :class:`~dsfunc.zero.policy.ShardSource`'s to say: cast from the
master by default; staged on the host and kept on the device between gathers with the optimizer offloaded
(:mod:`dsfunc.zero.offload.shards`).

The workspace also decides what the model's resident parameters show between micro-batches
(:meth:`~dsfunc.zero.binding.Binding.show`): views of the persistent copies, and for a lazy unit an
empty tensor, or the gathered copy while it is *exposed* (:meth:`Workspace.expose`: a forward through
the module outside a step, ``GatheredParameters``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from dsfunc.config.dtypes import SIXTEEN_BIT
from dsfunc.distributed import comm
from dsfunc.errors import InputError
from dsfunc.zero.binding import Binding
from dsfunc.zero.layout import ShardingPlan, Unit, unit_views
from dsfunc.zero.placeholders import ZeroParamStatus
from dsfunc.zero.policy import ShardSource

# id(resident parameter) -> (the parameter, its workspace, its unit's name), all weak: how
# GatheredParameters finds what to gather (keyed by id: tensors compare elementwise, so no WeakKeyDictionary)
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}


def _register(param: torch.Tensor, workspace: Workspace, unit: str) -> None:
    key = id(param)

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _OWNERS.get(key, (None,))[0] is ref:
            del _OWNERS[key]

    _OWNERS[key] = (weakref.ref(param, forget), weakref.ref(workspace), unit)


class UnitState(enum.Enum):
    """Where a lazy (stage-3) unit's gathered buffer is."""

    FREE = enum.auto()  # storage released
    GATHERING = enum.auto()  # an all-gather into it is in flight
    READY = enum.auto()  # holds the full unit


@dataclasses.dataclass
class _Exposure:
    """What the model's resident parameters show between micro-batches, and which units are exposed."""

    binding: Binding
    shown: dict[str, Any] = dataclasses.field(default_factory=dict)  # unit -> the flat its residents view (None: empty)
    gathered: dict[str, int] = dataclasses.field(default_factory=dict)  # lazy unit -> exposures holding it gathered
    master: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # unit -> full fp32 master shown


@dataclasses.dataclass
class ZeroStats:
    """Instrumentation a test (or a curious user) can read: what stage 3 held gathered at once."""

    live_units: set[str] = dataclasses.field(default_factory=set)
    max_live_units: int = 0
    max_live_elements: int = 0
    gathers: int = 0

    def note(self, plan: ShardingPlan) -> None:
        self.max_live_units = max(self.max_live_units, len(self.live_units))
        live = sum(plan.padded_size(plan.unit(n)) for n in self.live_units)
        self.max_live_elements = max(self.max_live_elements, live)


@dataclasses.dataclass
class _Gathering:
    """ZeRO-3's gathers: each lazy unit's state, the all-gathers in flight, and how far prefetching may go."""

    prefetch_budget: int | None  # live elements prefetching may reach (None: no prefetching)
    status: dict[str, UnitState] = dataclasses.field(default_factory=dict)
    in_flight: dict[str, tuple[comm.InFlight, torch.Tensor, Any]] = dataclasses.field(default_factory=dict)
    stats: ZeroStats = dataclasses.field(default_factory=ZeroStats)


class Workspace:
    """Compute copies per unit: persistent ones refreshed after updates, lazy ones gathered and freed."""

    def __init__(self, plan: ShardingPlan, *, binding: Binding, compute_dtype: torch.dtype, device: torch.device,
                 persistence_threshold: int, max_live_elements: int, prefetch: bool, source: ShardSource) -> None:
        self.plan = plan
        self.source = source  # where a gather reads its shard (dsfunc.zero.policy)
        self.compute_dtype = compute_dtype
        self.device = device
        self.active: Any = None  # the MicroBatchRuntime bound right now, for the module hooks
        self.lazy_units = frozenset(u.name for u in plan.units if plan.stage == 3 and u.module is not None
                                    and u.numel >= persistence_threshold)
        self.buffers: dict[str, torch.Tensor] = {}
        self.gathering = _Gathering(prefetch_budget=max_live_elements if prefetch else None)
        # the masters the copies were last built from, and their signature then (storage and version of each)
        self.synced: tuple[Mapping[str, torch.Tensor], tuple[Any, ...] | None] = ({}, None)
        self._exposure = _Exposure(binding)

    @property
    def stats(self) -> ZeroStats:
        """What stage 3 held gathered at once."""
        return self.gathering.stats

    @property
    def master(self) -> Mapping[str, torch.Tensor]:
        """The masters the copies were last built from."""
        return self.synced[0]

    @property
    def binding(self) -> Binding:
        """The model's resident parameters and buffers (:mod:`dsfunc.zero.binding`)."""
        return self._exposure.binding

    @property
    def aliases_master(self) -> bool:
        """Stage 0 in fp32: the compute copy is the master itself."""
        return self.plan.stage == 0 and self.compute_dtype == torch.float32

    def lazy(self, unit: Unit) -> bool:
        return unit.name in self.lazy_units

    def _flat_len(self, unit: Unit) -> int:
        return unit.numel if self.plan.stage == 0 else self.plan.padded_size(unit)

    # -- persistent copies -------------------------------------------------------------------------
    def lowp_targets(self) -> dict[str, torch.Tensor]:
        """Where an update may write this rank's new parameters in the compute dtype (persistent units,
        when that dtype is 16-bit): the whole copy at stage 0, this rank's slice of it otherwise."""
        if self.compute_dtype not in SIXTEEN_BIT:
            return {}
        out = {}
        for unit in self.plan.units:
            own = None if self.lazy(unit) else self.own_slice(unit)
            if own is not None:
                out[unit.name] = own
        return out

    def own_slice(self, unit: Unit) -> torch.Tensor | None:
        """This rank's slice of a persistent unit's compute copy (all of it at stage 0); None before it is built."""
        buf = self.buffers.get(unit.name)
        if buf is None:
            return None
        return buf if self.plan.stage == 0 else buf[slice(*self.plan.shard_bounds(unit))]

    @torch.no_grad()
    def refresh(self, master: Mapping[str, torch.Tensor], written: Iterable[str] = ()) -> None:
        """Rebuild every persistent copy from ``master`` (after an update, or for another state).

        ``written`` names units whose slice of the copy the update already wrote (:meth:`lowp_targets`, or
        sent as it went: :meth:`dsfunc.zero.policy.UpdateRunner.written`): those only need the all-gather.
        """
        self.settle()
        if self.aliases_master:
            self._synced(master)
            return
        written = set(written)
        works = []
        for unit in self.plan.units:
            if self.lazy(unit):
                if unit.name not in written:
                    self.source.refresh(unit, master[unit.name])
                continue
            buf = self.buffers.get(unit.name)
            if buf is None:
                buf = self.buffers[unit.name] = torch.empty(
                    self._flat_len(unit), dtype=self.compute_dtype, device=self.device)
            self.gathering.status[unit.name] = UnitState.READY
            if unit.name in written:
                if self.plan.stage:
                    src = buf[slice(*self.plan.shard_bounds(unit))]
                    works.append((comm.all_gather_flat(buf, src, self.plan.group_of(unit), async_op=True), src))
                continue
            src = self._shard(unit, master)
            works.append((comm.all_gather_flat(buf, src, self.plan.group_of(unit), async_op=True) if self.plan.stage
                          else _copy(buf, src), src))
        for work, _ in works:
            work.wait()
        self._synced(master)

    def settle(self) -> None:
        """Wait for what writes the masters in the background (:meth:`~dsfunc.zero.policy.ShardSource.settle`),
        if anything does: what reads the masters, or replaces them, comes after it."""
        if self.source.settle():
            self.synced = (self.master, _signature(self.master))  # it wrote them in place

    def _stale(self, master: Mapping[str, torch.Tensor]) -> bool:
        """Whether the copies were built from other masters than ``master`` (or before it changed). The
        masters being written in the background are the copies' own: each unit is waited for as it is gathered."""
        if self.source.writing:
            if master is self.master:
                return False
            self.settle()
        return self.synced[1] != _signature(master)

    def _synced(self, master: Mapping[str, torch.Tensor]) -> None:
        self.synced = (master, _signature(master))
        for unit in self.plan.units:
            self._show(unit)

    # -- what the module shows between micro-batches -----------------------------------------------
    def _show(self, unit: Unit) -> None:
        """Point ``unit``'s resident parameters at its current compute flat (empty for a lazy unit that
        is not exposed); nothing to do when they already view it."""
        exposure = self._exposure
        if unit.name in exposure.master:
            flat = exposure.master[unit.name]
        elif self.aliases_master:
            flat = self.master[unit.name]
        elif self.lazy(unit) and not exposure.gathered.get(unit.name):
            flat = None
        else:
            flat = self.buffers[unit.name]
        residents = self.binding.residents(unit.name)
        if exposure.shown.get(unit.name, False) is flat and (
                flat is None or residents[0].data_ptr() == flat.data_ptr()):
            return
        if flat is None:
            views = [torch.empty(0, dtype=self.compute_dtype, device=self.device)] * len(unit.params)
        else:
            views = unit_views(unit, flat)
        status = None
        if self.plan.stage == 3:
            status = ZeroParamStatus.NOT_AVAILABLE if flat is None else ZeroParamStatus.AVAILABLE
        self.binding.show(unit.name, views, status=status)
        exposure.shown[unit.name] = flat
        for p in self.binding.residents(unit.name):
            _register(p, self, unit.name)

    def shows(self, unit: Unit, flat: torch.Tensor) -> bool:
        """Whether ``unit``'s resident parameters are views of ``flat`` right now, each in its place."""
        if self._exposure.shown.get(unit.name) is not flat:
            return False
        base, size = flat.data_ptr(), flat.element_size()
        return all(p.data_ptr() == base + s.offset * size and p.shape == s.shape
                   for p, s in zip(self.binding.residents(unit.name), unit.params))

    def expose(self, unit: Unit) -> None:
        """Gather a lazy unit into its residents until the matching :meth:`hide` (nested calls count)."""
        gathered = self._exposure.gathered
        gathered[unit.name] = gathered.get(unit.name, 0) + 1
        if self.lazy(unit) and gathered[unit.name] == 1:
            self.ensure(unit, self.master)
            self._show(unit)

    def expose_master(self, unit: Unit) -> None:
        """Show the unit's full fp32 master in its residents, for writing (GatheredParameters with a
        modifier rank): the master itself when it is not sharded, else a copy gathered from the shards.
        :meth:`commit_master` writes it back."""
        self.settle()
        self._exposure.master[unit.name] = self.full_flat(unit, self.master[unit.name])
        self._show(unit)

    def full_flat(self, unit: Unit, shard: torch.Tensor) -> torch.Tensor:
        """The unit's full flat (padded) from this rank's ``shard`` of it: all-gathered from every rank's
        shard (a collective), or ``shard`` itself when the unit is not sharded."""
        if shard.device != self.device:
            shard = shard.to(self.device)  # an offloaded master is gathered, and shown, on the device
        if self.plan.ways_of(unit) == 1:
            return shard
        full = torch.empty(self.plan.padded_size(unit), dtype=shard.dtype, device=shard.device)
        comm.all_gather_flat(full, shard, self.plan.group_of(unit))
        return full

    @torch.no_grad()
    def commit_master(self, units: Iterable[Unit], src: int) -> None:
        """End :meth:`expose_master` for ``units``: the values rank ``src`` of each unit's own group wrote there
        become the master of every rank of that group, and the compute copies are rebuilt from them.

        As DeepSpeed's ``GatheredParameters(modifier_rank=src)``, ``src`` counts within the group a parameter is
        partitioned over: an expert unit's is its expert-data-parallel group (the ranks holding the same experts),
        so each ep position keeps its own experts, written by its group's rank ``src``."""
        units = list(units)
        outside = [u.name for u in units if not 0 <= src < self.plan.group_of(u).size]
        if outside:
            for unit in units:  # the writes are dropped: every rank keeps its master
                self._exposure.master.pop(unit.name)
            self.refresh(self.master)
            sizes = sorted({self.plan.group_of(u).size for u in units})
            raise InputError(
                f"GatheredParameters(modifier_rank={src}): {outside} are partitioned over groups of {sizes} ranks "
                "(an expert's: its expert-data-parallel ranks), and modifier_rank counts within that group, as in "
                "DeepSpeed; the writes were dropped. Use a modifier_rank below the group's size, or gather the "
                "expert parameters in a context of their own")
        for unit in units:
            full = self._exposure.master.pop(unit.name)
            comm.broadcast(full, self.plan.group_of(unit), src=src)
            master = self.master[unit.name]
            if full is not master:  # sharded, or offloaded
                start = self.plan.shard_bounds(unit)[0]
                master.copy_(full[start : start + master.numel()])
        self.refresh(self.master)

    def hide(self, unit: Unit) -> None:
        """Undo one :meth:`expose`; the last one empties the residents and frees the gathered copy."""
        self._exposure.gathered[unit.name] -= 1
        if self.lazy(unit) and self._exposure.gathered[unit.name] == 0:
            self._show(unit)
            self.release(unit)

    def ensure(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The unit's full compute flat, gathered if needed."""
        if self.aliases_master:
            return master[unit.name]
        if not self.lazy(unit):
            if self._stale(master):
                self.refresh(master)
            return self.buffers[unit.name]
        state = self.gathering.status.get(unit.name, UnitState.FREE)
        if state is UnitState.FREE:
            self._start_gather(unit, master)
            state = UnitState.GATHERING
        if state is UnitState.GATHERING:
            self._wait(unit)
        return self.buffers[unit.name]

    def _wait(self, unit: Unit) -> None:
        work, _src, hide = self.gathering.in_flight.pop(unit.name)
        with torch.no_grad(), hide:
            work.wait()
        self.gathering.status[unit.name] = UnitState.READY

    # -- stage 3 -----------------------------------------------------------------------------------
    def _start_gather(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> None:
        n = self._flat_len(unit)
        buf = self.buffers.get(unit.name)
        if buf is None:
            buf = self.buffers[unit.name] = torch.empty(n, dtype=self.compute_dtype, device=self.device)
        elif buf.untyped_storage().size() == 0:
            buf.untyped_storage().resize_(n * buf.element_size())
        src = self._gather_source(unit, master)
        # [Note: refills hidden from autograd] Autograd's saved views of this buffer must stay valid across
        # a free and a refill, so the refill must not bump the buffer's version counter. The version is
        # taken now and restored after wait(): gloo bumps it when the work completes, even in the background.
        hide = torch.autograd._unsafe_preserve_version_counter(buf)
        with torch.no_grad(), hide, _on_stream(self.source.stream, self.device) as stream:
            src = self.source.to_device(unit, src)
            work = comm.all_gather_flat(buf, src, self.plan.group_of(unit), async_op=True)
            if stream is not None:
                work = _AfterStream(work, stream)
        self.gathering.in_flight[unit.name] = (work, src, hide)
        self.gathering.status[unit.name] = UnitState.GATHERING
        self.gathering.stats.live_units.add(unit.name)
        self.gathering.stats.gathers += 1
        self.gathering.stats.note(self.plan)

    def _shard(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This rank's shard of ``unit`` (all of it at stage 0) in the compute dtype, on the device."""
        return self.source.shard(unit, master[unit.name])

    def _gather_source(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What a lazy unit's all-gather sends (:meth:`~dsfunc.zero.policy.ShardSource.gather_input`), after a
        refresh where the source derives it from copies built for other masters."""
        if self.source.derived and self._stale(master):
            self.refresh(master)
        return self.source.gather_input(unit, master[unit.name])

    def release(self, unit: Unit) -> None:
        """Free a lazy unit's gathered storage (idempotent; an exposed unit stays until its last hide)."""
        if not self.lazy(unit) or self.gathering.status.get(unit.name, UnitState.FREE) is UnitState.FREE:
            return
        if self._exposure.gathered.get(unit.name):
            return
        if unit.name in self.gathering.in_flight:
            self._wait(unit)
        self.buffers[unit.name].untyped_storage().resize_(0)
        self.gathering.status[unit.name] = UnitState.FREE
        self.gathering.stats.live_units.discard(unit.name)

    def release_all(self) -> None:
        """Free every lazy unit (after a micro-batch, or when one is abandoned)."""
        for unit in self.plan.units:
            self.release(unit)

    def next_units(self, unit: Unit) -> list[Unit]:
        """The lazy unit after ``unit``: one unit of lookahead keeps at most two units gathered."""
        units = [u for u in self.plan.units if self.lazy(u)]
        i = units.index(unit)
        return units[i + 1 : i + 2]

    def prefetch(self, units: Iterable[Unit], master: Mapping[str, torch.Tensor]) -> None:
        """Start gathering ``units`` now, within the prefetch and live-parameter budgets."""
        if self.gathering.prefetch_budget is None:
            return
        for unit in units:
            if self.gathering.status.get(unit.name, UnitState.FREE) is not UnitState.FREE:
                continue
            live = sum(self.plan.padded_size(self.plan.unit(n)) for n in self.gathering.stats.live_units)
            if live + self.plan.padded_size(unit) > self.gathering.prefetch_budget:
                return
            self._start_gather(unit, master)


def owner(param: torch.Tensor) -> tuple[Workspace, Unit] | None:
    """The workspace and unit whose resident ``param`` is (None for any other tensor)."""
    found = _OWNERS.get(id(param))
    if found is None or found[0]() is not param or found[1]() is None:
        return None
    workspace = found[1]()
    return workspace, workspace.plan.unit(found[2])


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None, device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    """Run the block on ``stream`` (None: where it is) once ``stream`` has caught up with the current one:
    what the block writes was allocated on the current stream, and earlier kernels may still use it."""
    if stream is None:
        yield None
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


class _AfterStream:
    """A gather issued on a side stream: waiting for it makes the current stream wait for that one too."""

    def __init__(self, work: comm.InFlight, stream: torch.cuda.Stream) -> None:
        self.work = work
        self.event = stream.record_event()

    def wait(self) -> bool:
        self.work.wait()
        torch.cuda.current_stream().wait_event(self.event)
        return True


def _copy(dst: torch.Tensor, src: torch.Tensor) -> comm.InFlight:
    dst.copy_(src)
    return comm.Done()


def _signature(master: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """Which masters the persistent copies were built from (storage and version of each)."""
    return tuple((t.data_ptr(), t._version) for t in master.values())
