"""ZeRO sharding: the plan (units, flat layout, shards) and the runtime that binds and reduces.

Parameters are grouped into **units** (default: each block of the model's largest ``nn.ModuleList``, plus
a root unit for everything else). A unit's parameters live in one flat buffer in a fixed order that does
not depend on the world size; the buffer is split like ``torch.chunk``: ``S = ceil(N / W)`` elements per
rank, padding only at the tail. What each stage keeps per rank (Ψ = parameter count):

* stage 0: full fp32 master + full optimizer state; grads all-reduced.
* stage 1: full compute copy, 1/W of master and optimizer state; grads reduced to the shard at the end.
* stage 2: stage 1, but grads are reduce-scattered per unit as backward produces them (1/W kept).
* stage 3: stage 2, and the compute copy too is gathered per unit just before its forward, freed after,
  re-gathered before its backward; the next unit is prefetched while this one computes.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import nn

from dsfunc.dist import comm
from dsfunc.zero.layout import (  # noqa: F401
    ROOT,
    ParamSlot,
    ShardingPlan,
    Unit,
    find_unit_modules,
    flatten_unit,
    local_shard,
    make_plan,
    unit_views,
)


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


class _Slots:
    """Where each unit's parameters (and each buffer) sit in the skeleton, with their meta placeholders."""

    def __init__(self, skeleton: nn.Module, plan: ShardingPlan, buffer_names: Iterable[str]) -> None:
        def place(name: str) -> tuple[nn.Module, str, dict[str, Any]]:
            path, _, attr = name.rpartition(".")
            module = skeleton.get_submodule(path) if path else skeleton
            table = module._parameters if attr in module._parameters else module._buffers
            return module, attr, table

        self.units: dict[str, list[list[tuple[dict[str, Any], str, Any]]]] = {}
        for unit in plan.units:
            per_param = []
            for slot in unit.params:
                entries = []
                for alias in slot.aliases:
                    _, attr, table = place(alias)
                    entries.append((table, attr, table[attr]))
                per_param.append(entries)
            self.units[unit.name] = per_param
        self.buffers = {}
        for name in buffer_names:
            _, attr, table = place(name)
            self.buffers[name] = (table, attr, table[attr])

    def bind_unit(self, unit: str, views: Sequence[torch.Tensor]) -> None:
        for entries, view in zip(self.units[unit], views):
            for table, attr, _ in entries:
                table[attr] = view

    def bind_buffer(self, name: str, tensor: torch.Tensor) -> None:
        table, attr, _ = self.buffers[name]
        table[attr] = tensor

    def restore(self) -> None:
        """Put the meta placeholders back so the skeleton keeps no reference to this step's graph."""
        for per_param in self.units.values():
            for entries in per_param:
                for table, attr, placeholder in entries:
                    table[attr] = placeholder
        for table, attr, placeholder in self.buffers.values():
            table[attr] = placeholder


class Binding:
    """Binds parameters into the skeleton for one micro-batch and collects their gradients.

    This base class binds a plain mapping ``unit -> flat tensor`` (full, unsharded) and returns the
    local gradients: what :func:`dsfunc.value_and_grad` uses when no :func:`dsfunc.shard` wraps it.
    """

    def __init__(self, program: Any, flats: Mapping[str, torch.Tensor]) -> None:
        self.program = program
        self.flats = flats
        self.leaves: list[torch.Tensor] = []
        self._local: dict[str, torch.Tensor] = {}
        self._leaf_of: dict[str, torch.Tensor] = {}
        self._views: dict[str, list[torch.Tensor]] = {}

    # -- per micro-batch -------------------------------------------------------------------------
    def begin_micro(self, index: int, count: int) -> None:
        self.micro_index, self.micro_count = index, count
        self.program.workspace.session = self
        self.leaves = []
        self._leaf_of = {}
        self._views = {}
        for unit in self.program.plan.units:
            if self.binds_eagerly(unit):
                self.bind(unit)

    def binds_eagerly(self, unit: Unit) -> bool:
        return True

    def compute_flat(self, unit: Unit) -> torch.Tensor:
        return self.flats[unit.name]

    def bind(self, unit: Unit) -> None:
        """Make ``unit``'s parameters visible to the skeleton as views of a fresh autograd leaf."""
        if unit.name in self._leaf_of:
            self.program.slots.bind_unit(unit.name, self._views[unit.name])
            return
        flat = self.compute_flat(unit)
        leaf = flat.detach().requires_grad_()
        me = weakref.ref(self)  # weak: a cycle leaf -> hook -> binding -> leaf would keep whole states alive
        leaf.register_post_accumulate_grad_hook(lambda t, u=unit: me()._on_grad(u, t))
        self._leaf_of[unit.name] = leaf
        self.leaves.append(leaf)
        views = unit_views(unit, leaf)
        self._views[unit.name] = views
        self.program.slots.bind_unit(unit.name, views)

    def pre_forward(self, unit: Unit) -> None:
        """Module hook before a lazily gathered unit runs (every unit is bound eagerly here)."""

    def post_forward(self, unit: Unit, output: Any) -> None:
        """Module hook after a lazily gathered unit ran."""

    def _on_grad(self, unit: Unit, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        self.reduce(unit, grad)

    def reduce(self, unit: Unit, grad: torch.Tensor) -> None:
        prev = self._local.get(unit.name)
        g = grad.float()
        self._local[unit.name] = g if prev is None else prev.add_(g)

    def end_micro(self) -> None:
        self.program.slots.restore()
        self.program.workspace.session = None
        self._leaf_of, self._views = {}, {}

    def finish(self) -> dict[str, torch.Tensor] | None:
        """Gradients after the last micro-batch (fp32); ``None`` for a unit nothing reached."""
        out = {u.name: self._local.get(u.name) for u in self.program.plan.units}
        self._local = {}
        return out


class ShardedBinding(Binding):
    """The ``shard`` transform's runtime: gathers compute parameters and reduces gradients per ZeRO stage.

    Reductions are issued from the gradient hooks as backward produces each unit's gradient (async), so
    communication overlaps the rest of backward; stage 3 also gathers lazily from module hooks.
    """

    def __init__(self, program: Any, master: Mapping[str, torch.Tensor]) -> None:
        super().__init__(program, {})
        self.plan: ShardingPlan = program.plan
        self.master = master
        self.workspace: Workspace = program.workspace
        self.comm_dtype = program.comm_dtype
        self.pending: list[tuple[comm.Pending, Callable[[], None]]] = []
        self.reduced: set[str] = set()
        self.grads: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        # Reductions in flight during backward: each holds a full-size gradient until it finishes, so
        # waiting on older ones as new ones start bounds that memory (the wait only orders streams on NCCL).
        self.max_inflight = 2

    def binds_eagerly(self, unit: Unit) -> bool:
        return not self.workspace.lazy(unit)

    def begin_micro(self, index: int, count: int) -> None:
        self.reduced = set()
        self.order = []
        super().begin_micro(index, count)

    def compute_flat(self, unit: Unit) -> torch.Tensor:
        return self.workspace.ensure(unit, self.master)

    # -- stage-3 module hooks (called by Workspace) --------------------------------------------------
    def pre_forward(self, unit: Unit) -> None:
        if unit.name not in self.order:
            self.order.append(unit.name)
        self.workspace.ensure(unit, self.master)  # a unit run twice in one forward is re-gathered
        self.bind(unit)
        self.workspace.prefetch(self.workspace.next_units(unit), self.master)

    def post_forward(self, unit: Unit, output: Any) -> None:
        self.workspace.release(unit)
        tensors = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        me = weakref.ref(self)
        for t in tensors:
            t.register_hook(lambda g, u=unit: me()._pre_backward(u, g))

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        self.workspace.ensure(unit, self.master)
        i = self.order.index(unit.name)
        if i > 0:
            self.workspace.prefetch([self.plan.unit(self.order[i - 1])], self.master)
        return grad

    # -- gradient reduction ----------------------------------------------------------------------
    def _on_grad(self, unit: Unit, leaf: torch.Tensor) -> None:
        super()._on_grad(unit, leaf)
        if self.workspace.lazy(unit):
            self.workspace.release(unit)

    def reduce(self, unit: Unit, grad: torch.Tensor) -> None:
        self.reduced.add(unit.name)
        stage, last = self.plan.stage, self.micro_index == self.micro_count - 1
        if stage <= 1 and not last:
            super().reduce(unit, grad)  # accumulate locally; one reduction after the last micro-batch
            return
        full = grad.to(self.comm_dtype)
        local = self._local.pop(unit.name, None) if stage <= 1 else None
        if local is not None:
            full = full + local.to(self.comm_dtype)
        if stage == 0:  # all-reduce in chunks of at most reduce_bucket_size elements
            chunks = full.split(self.program.config.zero_optimization.reduce_bucket_size)
            for chunk in chunks[:-1]:
                self.pending.append((comm.all_reduce_sum(chunk, async_op=True), lambda: None))
            work = comm.all_reduce_sum(chunks[-1], async_op=True)
            self.pending.append((work, lambda u=unit, t=full: self._store(u, t)))
        else:
            out = torch.empty(self.plan.shard_size(unit), dtype=self.comm_dtype, device=full.device)
            work = comm.reduce_scatter_sum(out, full, async_op=True)
            self.pending.append((work, lambda u=unit, t=out, keep=full: self._store(u, t)))
        self._drain(keep=self.max_inflight)

    def _store(self, unit: Unit, reduced: torch.Tensor) -> None:
        reduced = reduced.float()
        prev = self.grads.get(unit.name)
        self.grads[unit.name] = reduced if prev is None else prev.add_(reduced)

    def _drain(self, keep: int = 0) -> None:
        """Finish all but the ``keep`` newest reductions (their full-size inputs are then freed)."""
        while len(self.pending) > keep:
            work, store = self.pending.pop(0)
            work.wait()
            store()

    def end_micro(self) -> None:
        super().end_micro()
        for unit in self.plan.units:  # units no loss reached still join the collectives
            if unit.name not in self.reduced:
                length = self.plan.padded_size(unit) if self.plan.stage >= 1 else unit.numel
                self.reduce(unit, torch.zeros(length, device=self.workspace.device))
            if self.workspace.lazy(unit):
                self.workspace.release(unit)
        if self.plan.stage >= 2:
            self._drain()

    def finish(self) -> dict[str, torch.Tensor]:
        self._drain()
        grads, self.grads = self.grads, {}
        return grads


class Workspace:
    """The compute-dtype copies of the parameters that forward and backward read.

    Persistent units (stages 0-2, and stage-3 units below ``stage3_param_persistence_threshold``) keep
    a full copy that is refreshed after every update; lazy units (stage 3) are all-gathered on demand
    into a buffer whose storage is freed after use (autograd's saved views see the refill).
    """

    def __init__(self, plan: ShardingPlan, *, compute_dtype: torch.dtype, device: torch.device,
                 persistence_threshold: int, max_live_elements: int, prefetch: bool) -> None:
        self.plan = plan
        self.compute_dtype = compute_dtype
        self.device = device
        self.max_live_elements = max_live_elements
        self.prefetch_enabled = prefetch
        self.stats = ZeroStats()
        self.session: ShardedBinding | None = None
        self._lazy = {
            u.name: plan.stage == 3 and u.module is not None and u.numel >= persistence_threshold
            for u in plan.units
        }
        self.buffers: dict[str, torch.Tensor] = {}
        self.status: dict[str, str] = {}  # "ready" | "gathering" | "free"
        self.inflight: dict[str, tuple[comm.Pending, torch.Tensor, Any]] = {}
        self.synced_with: tuple[Any, ...] | None = None
        self.aliases_master = plan.stage == 0 and compute_dtype == torch.float32

    def lazy(self, unit: Unit) -> bool:
        return self._lazy[unit.name]

    def _flat_len(self, unit: Unit) -> int:
        return unit.numel if self.plan.stage == 0 else self.plan.padded_size(unit)

    # -- persistent copies -------------------------------------------------------------------------
    def lowp_targets(self) -> dict[str, torch.Tensor]:
        """Where an update may write this rank's new parameters in the compute dtype (persistent units,
        when that dtype is 16-bit): the whole copy at stage 0, this rank's slice of it otherwise."""
        if self.compute_dtype not in (torch.bfloat16, torch.float16):
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

        ``written`` names units whose slice of the copy the update already wrote (:meth:`lowp_targets`):
        those only need the all-gather.
        """
        if self.aliases_master:
            self.synced_with = _signature(master)
            return
        written = set(written)
        works = []
        for unit in self.plan.units:
            if self.lazy(unit):
                continue
            buf = self.buffers.get(unit.name)
            if buf is None:
                buf = self.buffers[unit.name] = torch.empty(
                    self._flat_len(unit), dtype=self.compute_dtype, device=self.device)
            self.status[unit.name] = "ready"
            if unit.name in written:
                if self.plan.stage:
                    size = self.plan.shard_size(unit)
                    src = buf[self.plan.rank * size : (self.plan.rank + 1) * size]
                    works.append((comm.all_gather_flat(buf, src, async_op=True), src))
                continue
            src = master[unit.name].to(self.compute_dtype)
            works.append((comm.all_gather_flat(buf, src, async_op=True) if self.plan.stage else _copy(buf, src), src))
        for work, _ in works:
            work.wait()
        self.synced_with = _signature(master)

    def ensure(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The unit's full compute flat, gathered if needed."""
        if self.aliases_master:
            return master[unit.name]
        if not self.lazy(unit):
            if self.synced_with != _signature(master):
                self.refresh(master)
            return self.buffers[unit.name]
        state = self.status.get(unit.name, "free")
        if state == "free":
            self._start_gather(unit, master)
            state = "gathering"
        if state == "gathering":
            self._wait(unit)
        return self.buffers[unit.name]

    def _wait(self, unit: Unit) -> None:
        work, _src, hide = self.inflight.pop(unit.name)
        with torch.no_grad(), hide:
            work.wait()
        self.status[unit.name] = "ready"

    # -- stage 3 -----------------------------------------------------------------------------------
    def _start_gather(self, unit: Unit, master: Mapping[str, torch.Tensor]) -> None:
        n = self._flat_len(unit)
        buf = self.buffers.get(unit.name)
        if buf is None:
            buf = self.buffers[unit.name] = torch.empty(n, dtype=self.compute_dtype, device=self.device)
        elif buf.untyped_storage().size() == 0:
            buf.untyped_storage().resize_(n * buf.element_size())
        src = master[unit.name].to(self.compute_dtype)
        # Hide the refill from autograd (its saved views of this buffer must stay valid). The version
        # is taken now and restored after wait(): gloo bumps it when the work completes, even in the
        # background.
        hide = torch.autograd._unsafe_preserve_version_counter(buf)
        with torch.no_grad(), hide:
            work = comm.all_gather_flat(buf, src, async_op=True)
        self.inflight[unit.name] = (work, src, hide)
        self.status[unit.name] = "gathering"
        self.stats.live_units.add(unit.name)
        self.stats.gathers += 1
        self.stats.note(self.plan)

    def release(self, unit: Unit) -> None:
        """Free a lazy unit's gathered storage (idempotent)."""
        if not self.lazy(unit) or self.status.get(unit.name, "free") == "free":
            return
        if unit.name in self.inflight:
            self._wait(unit)
        self.buffers[unit.name].untyped_storage().resize_(0)
        self.status[unit.name] = "free"
        self.stats.live_units.discard(unit.name)

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
            if self.status.get(unit.name, "free") != "free":
                continue
            live = sum(self.plan.padded_size(self.plan.unit(n)) for n in self.stats.live_units)
            if live + self.plan.padded_size(unit) > self.max_live_elements:
                return
            self._start_gather(unit, master)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> comm.Pending:
    dst.copy_(src)
    return comm.Done()


def _signature(master: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    return tuple((t.data_ptr(), t._version) for t in master.values())


def install_hooks(skeleton: nn.Module, workspace: Workspace) -> None:
    """Forward hooks on stage-3 unit modules: gather before, free after, re-gather before backward."""
    for unit in workspace.plan.units:
        if not workspace.lazy(unit):
            continue
        module = skeleton.get_submodule(unit.module)

        def pre(mod: nn.Module, args: Any, u: Unit = unit) -> None:
            if workspace.session is not None:
                workspace.session.pre_forward(u)

        def post(mod: nn.Module, args: Any, output: Any, u: Unit = unit) -> None:
            if workspace.session is not None:
                workspace.session.post_forward(u, output)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def segment_norm_fn(plan: ShardingPlan, device: torch.device) -> Callable[[Any], Any]:
    """Per-parameter L2 norms over flat shards, broadcast back per element (Lamb's trust ratio).

    The per-element segment index it needs is built on the first call, so optimizers that never ask
    (Adam, SGD, ...) pay no memory for it.
    """
    ids: dict[str, torch.Tensor] = {}

    def segment_ids() -> dict[str, torch.Tensor]:
        for unit in plan.units:
            start, stop = plan.local_range(unit)
            seg = torch.full((plan.shard_size(unit),), len(unit.params), dtype=torch.int32)
            for i, slot in enumerate(unit.params):
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, stop)
                if lo < hi:
                    seg[lo - start : hi - start] = i
            ids[unit.name] = seg.to(device)
        return ids

    def segment_norm(squares: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seg = ids or segment_ids()
        sums = {
            name: torch.zeros(len(plan.unit(name).params) + 1, dtype=torch.float32, device=sq.device)
            .index_add_(0, seg[name], sq.float())
            for name, sq in squares.items()
        }
        if plan.ways > 1:
            packed = torch.cat(list(sums.values()))
            comm.all_reduce_sum(packed)
            sums = dict(zip(sums, packed.split([s.numel() for s in sums.values()])))
        return {name: s.sqrt()[seg[name]].to(squares[name].dtype) for name, s in sums.items()}

    return segment_norm
