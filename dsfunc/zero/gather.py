"""The compute copies of the parameters that forward and backward read, and ZeRO-3's gather and free.

A :class:`Workspace` is the one mutable object of a run (owned by its :class:`~dsfunc.init.Program`,
shared by every state of the run). It caches what is derived from the fp32 masters and never
checkpointed: the compute-dtype copy of each unit, and at stage 3 the gathered buffers and their
all-gathers in flight. It also points at the micro-batch runtime that is bound right now
(:attr:`Workspace.active`), which the stage-3 module hooks call.

Persistent units (stages 0-2, and stage-3 units below ``stage3_param_persistence_threshold``) keep a
full copy, rebuilt after every update. Lazy units (stage 3) are all-gathered on demand into a buffer
whose storage is freed after use; autograd's saved views of the buffer see the refill.

With the optimizer offloaded (:mod:`dsfunc.zero.offload`) the masters are in host memory: each copy is
built from the unit's compute-dtype shard staged on the host and copied to the device. A lazy unit then
keeps that device shard between gathers, so a gather costs no host-to-device copy, unless the parameters
are offloaded too (``offload_param``), when each gather streams it from the host again.

The workspace also decides what the model's resident parameters show between micro-batches
(:meth:`~dsfunc.zero.binding.Slots.show`): views of the persistent copies, and for a lazy unit an
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

from dsfunc.distributed import comm
from dsfunc.zero.binding import Slots
from dsfunc.zero.layout import ShardingPlan, Unit, unit_views
from dsfunc.zero.offload import HostOffload
from dsfunc.zero.placeholders import ZeroParamStatus

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


class Workspace:
    """Compute copies per unit: persistent ones refreshed after updates, lazy ones gathered and freed."""

    def __init__(self, plan: ShardingPlan, *, slots: Slots, compute_dtype: torch.dtype, device: torch.device,
                 persistence_threshold: int, max_live_elements: int, prefetch: bool,
                 host: HostOffload | None = None) -> None:
        self.plan = plan
        self.host = host
        self.slots = slots
        self.compute_dtype = compute_dtype
        self.device = device
        self.max_live_elements = max_live_elements
        self.prefetch_enabled = prefetch
        self.stats = ZeroStats()
        self.active: Any = None  # the MicroBatchRuntime bound right now, for the module hooks
        self._lazy = {
            u.name: plan.stage == 3 and u.module is not None and u.numel >= persistence_threshold
            for u in plan.units
        }
        self.buffers: dict[str, torch.Tensor] = {}
        self.status: dict[str, UnitState] = {}
        self.inflight: dict[str, tuple[comm.Pending, torch.Tensor, Any]] = {}
        self.shards: dict[str, torch.Tensor] = {}  # offload, lazy unit -> its compute-dtype shard on the device
        self.synced_with: tuple[Any, ...] | None = None
        self.aliases_master = plan.stage == 0 and compute_dtype == torch.float32
        self.master: Mapping[str, torch.Tensor] = {}  # the masters the copies were last built from
        self._shown: dict[str, Any] = {}  # unit -> the flat its residents view (None: empty)
        self._exposed: dict[str, int] = {}  # lazy unit -> how many exposures hold it gathered
        self._exposed_master: dict[str, torch.Tensor] = {}  # unit -> full fp32 master shown for writing

    def lazy(self, unit: Unit) -> bool:
        return self._lazy[unit.name]

    def _flat_len(self, unit: Unit) -> int:
        return unit.numel if self.plan.stage == 0 else self.plan.padded_size(unit)

    # -- persistent copies -------------------------------------------------------------------------
    def lowp_targets(self) -> dict[str, torch.Tensor]:
        """Where an update may write this rank's new parameters in the compute dtype (persistent units,
        when that dtype is 16-bit): the whole copy at stage 0, this rank's slice of it otherwise. None with
        the optimizer offloaded: the update runs on the host, and the host stages the copy itself."""
        if self.host is not None or self.compute_dtype not in (torch.bfloat16, torch.float16):
            return {}
        out = {}
        for unit in self.plan.units:
            buf = self.buffers.get(unit.name)
            if self.lazy(unit) or buf is None:
                continue
            size = self.plan.shard_size(unit)
            out[unit.name] = buf if self.plan.stage == 0 else buf[self.plan.rank * size : (self.plan.rank + 1) * size]
        return out

    @torch.no_grad()
    def refresh(self, master: Mapping[str, torch.Tensor], written: Iterable[str] = ()) -> None:
        """Rebuild every persistent copy from ``master`` (after an update, or for another state).

        ``written`` names units whose slice of the copy the update already wrote (:meth:`lowp_targets`,
        or with offload :meth:`send_updated`): those only need the all-gather.
        """
        self.settle()
        if self.aliases_master:
            self._synced(master)
            return
        written = set(written)
        works = []
        for unit in self.plan.units:
            if self.lazy(unit):
                if self.host is not None and unit.name not in written:
                    self._send_lazy(unit, master[unit.name])
                continue
            buf = self.buffers.get(unit.name)
            if buf is None:
                buf = self.buffers[unit.name] = torch.empty(
                    self._flat_len(unit), dtype=self.compute_dtype, device=self.device)
            self.status[unit.name] = UnitState.READY
            if unit.name in written:
                if self.plan.stage:
                    size = self.plan.shard_size(unit)
                    src = buf[self.plan.rank * size : (self.plan.rank + 1) * size]
                    works.append((comm.all_gather_flat(buf, src, self.plan.group, async_op=True), src))
                continue
            src = self._shard(unit, master)
            works.append((comm.all_gather_flat(buf, src, self.plan.group, async_op=True) if self.plan.stage
                          else _copy(buf, src), src))
        for work, _ in works:
            work.wait()
        self._synced(master)

    def send_updated(self, name: str, master: torch.Tensor, staged: bool = False) -> bool:
        """Stage unit ``name``'s new host master (unless the update already wrote its staging buffer:
        ``staged``) and start its copy into its place on the device (offload; the host update calls this per
        unit, so the copy overlaps the next unit's update). True when it did: :meth:`refresh` then counts
        the unit as written."""
        unit = self.plan.unit(name)
        if self.lazy(unit):
            self._send_lazy(unit, master, staged)
            return True
        buf = self.buffers.get(name)
        if buf is None:  # no copy built yet: refresh builds it
            return False
        size = self.plan.shard_size(unit)
        own = buf if self.plan.stage == 0 else buf[self.plan.rank * size : (self.plan.rank + 1) * size]
        self.host.send(unit, self.host.staged(unit, master) if staged else self.host.stage(unit, master),
                       out=own)
        return True

    def _send_lazy(self, unit: Unit, master: torch.Tensor, staged: bool = False) -> None:
        """Stage a lazy unit's host master (unless ``staged`` already) and, unless its parameters stay on the
        host, copy it into the device shard its gathers send (in place: no second copy of the shards)."""
        staged = self.host.staged(unit, master) if staged else self.host.stage(unit, master)
        if not self.host.params:
            self.shards[unit.name] = self.host.send(unit, staged, out=self.shards.get(unit.name))

    def settle(self) -> None:
        """Wait for the host update in the background (:mod:`dsfunc.zero.host_update`), if one is pending:
        what reads the masters, or replaces them, comes after it."""
        if self.host is not None and self.host.pending.wait():
            self.synced_with = _signature(self.master)  # the update wrote them in place

    def _stale(self, master: Mapping[str, torch.Tensor]) -> bool:
        """Whether the copies were built from other masters than ``master`` (or before it changed). The
        masters a pending update is writing are the copies' own: each unit is waited for as it is gathered."""
        if self.host is not None and self.host.pending.busy:
            if master is self.master:
                return False
            self.settle()
        return self.synced_with != _signature(master)

    def _synced(self, master: Mapping[str, torch.Tensor]) -> None:
        self.synced_with = _signature(master)
        self.master = master
        for unit in self.plan.units:
            self._show(unit)

    # -- what the module shows between micro-batches -----------------------------------------------
    def _show(self, unit: Unit) -> None:
        """Point ``unit``'s resident parameters at its current compute flat (empty for a lazy unit that
        is not exposed); nothing to do when they already view it."""
        if unit.name in self._exposed_master:
            flat = self._exposed_master[unit.name]
        elif self.aliases_master:
            flat = self.master[unit.name]
        elif self.lazy(unit) and not self._exposed.get(unit.name):
            flat = None
        else:
            flat = self.buffers[unit.name]
        residents = self.slots.residents(unit.name)
        if self._shown.get(unit.name, False) is flat and (flat is None or residents[0].data_ptr() == flat.data_ptr()):
            return
        if flat is None:
            views = [torch.empty(0, dtype=self.compute_dtype, device=self.device)] * len(unit.params)
        else:
            views = unit_views(unit, flat)
        status = None
        if self.plan.stage == 3:
            status = ZeroParamStatus.NOT_AVAILABLE if flat is None else ZeroParamStatus.AVAILABLE
        self.slots.show(unit.name, views, status=status)
        self._shown[unit.name] = flat
        for p in self.slots.residents(unit.name):
            _register(p, self, unit.name)

    def shows(self, unit: Unit, flat: torch.Tensor) -> bool:
        """Whether ``unit``'s resident parameters are views of ``flat`` right now, each in its place."""
        if self._shown.get(unit.name) is not flat:
            return False
        base, size = flat.data_ptr(), flat.element_size()
        return all(p.data_ptr() == base + s.offset * size and p.shape == s.shape
                   for p, s in zip(self.slots.residents(unit.name), unit.params))

    def expose(self, unit: Unit) -> None:
        """Gather a lazy unit into its residents until the matching :meth:`hide` (nested calls count)."""
        self._exposed[unit.name] = self._exposed.get(unit.name, 0) + 1
        if self.lazy(unit) and self._exposed[unit.name] == 1:
            self.ensure(unit, self.master)
            self._show(unit)

    def expose_master(self, unit: Unit) -> None:
        """Show the unit's full fp32 master in its residents, for writing (GatheredParameters with a
        modifier rank): the master itself when it is not sharded, else a copy gathered from the shards.
        :meth:`commit_master` writes it back."""
        self.settle()
        self._exposed_master[unit.name] = self.full_flat(unit, self.master[unit.name])
        self._show(unit)

    def full_flat(self, unit: Unit, shard: torch.Tensor) -> torch.Tensor:
        """The unit's full flat (padded) from this rank's ``shard`` of it: all-gathered from every rank's
        shard (a collective), or ``shard`` itself when the unit is not sharded."""
        if shard.device != self.device:
            shard = shard.to(self.device)  # an offloaded master is gathered, and shown, on the device
        if self.plan.ways == 1:
            return shard
        full = torch.empty(self.plan.padded_size(unit), dtype=shard.dtype, device=shard.device)
        comm.all_gather_flat(full, shard, self.plan.group)
        return full

    @torch.no_grad()
    def commit_master(self, units: Iterable[Unit], src: int) -> None:
        """End :meth:`expose_master` for ``units``: rank ``src``'s values (what the script wrote there)
        become every rank's master, and the compute copies are rebuilt from them."""
        for unit in units:
            full = self._exposed_master.pop(unit.name)
            comm.broadcast(full, self.plan.group, src=src)
            master = self.master[unit.name]
            if full is not master:  # sharded, or offloaded
                start = self.plan.rank * master.numel() if self.plan.ways > 1 else 0
                master.copy_(full[start : start + master.numel()])
        self.refresh(self.master)

    def hide(self, unit: Unit) -> None:
        """Undo one :meth:`expose`; the last one empties the residents and frees the gathered copy."""
        self._exposed[unit.name] -= 1
        if self.lazy(unit) and self._exposed[unit.name] == 0:
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
        state = self.status.get(unit.name, UnitState.FREE)
        if state is UnitState.FREE:
            self._start_gather(unit, master)
            state = UnitState.GATHERING
        if state is UnitState.GATHERING:
            self._wait(unit)
        return self.buffers[unit.name]

    def _wait(self, unit: Unit) -> None:
        work, _src, hide = self.inflight.pop(unit.name)
        with torch.no_grad(), hide:
            work.wait()
        self.status[unit.name] = UnitState.READY

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
        streamed = self.host is not None and self.host.params
        with torch.no_grad(), hide, _on_stream(self.host.transfer if streamed else None, self.device) as stream:
            if streamed:  # offload_param: the host shard streams in beside the kernels, not between them
                src = self.host.send(unit, src)
            work = comm.all_gather_flat(buf, src, self.plan.group, async_op=True)
            if stream is not None:
                work = _AfterStream(work, stream)
        self.inflight[unit.name] = (work, src, hide)
        self.status[unit.name] = UnitState.GATHERING
        self.stats.live_units.add(unit.name)
        self.stats.gathers += 1
        self.stats.note(self.plan)

    def _shard(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This rank's shard of ``unit`` (all of it at stage 0) in the compute dtype, on the device."""
        if self.host is None:
            return master[unit.name].to(self.compute_dtype)
        return self.host.send(unit, self.host.stage(unit, master[unit.name]))

    def _gather_source(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What a lazy unit's all-gather sends: the shard cast from the master, or with offload the device
        shard kept since the last update, or (``offload_param``) the host shard, to stream to the device."""
        if self.host is None:
            return master[unit.name].to(self.compute_dtype)
        if self._stale(master):
            self.refresh(master)
        self.host.pending.wait_unit(unit.name)
        if self.host.params:
            return self.host.staged(unit, master[unit.name])
        return self.shards[unit.name]

    def release(self, unit: Unit) -> None:
        """Free a lazy unit's gathered storage (idempotent; an exposed unit stays until its last hide)."""
        if not self.lazy(unit) or self.status.get(unit.name, UnitState.FREE) is UnitState.FREE:
            return
        if self._exposed.get(unit.name):
            return
        if unit.name in self.inflight:
            self._wait(unit)
        self.buffers[unit.name].untyped_storage().resize_(0)
        self.status[unit.name] = UnitState.FREE
        self.stats.live_units.discard(unit.name)

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
        if not self.prefetch_enabled:
            return
        for unit in units:
            if self.status.get(unit.name, UnitState.FREE) is not UnitState.FREE:
                continue
            live = sum(self.plan.padded_size(self.plan.unit(n)) for n in self.stats.live_units)
            if live + self.plan.padded_size(unit) > self.max_live_elements:
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

    def __init__(self, work: comm.Pending, stream: torch.cuda.Stream) -> None:
        self.work = work
        self.event = stream.record_event()

    def wait(self) -> bool:
        self.work.wait()
        torch.cuda.current_stream().wait_event(self.event)
        return True


def _copy(dst: torch.Tensor, src: torch.Tensor) -> comm.Pending:
    dst.copy_(src)
    return comm.Done()


def _signature(master: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """Which masters the persistent copies were built from (storage and version of each)."""
    return tuple((t.data_ptr(), t._version) for t in master.values())
