"""How an opened DeepSpeed checkpoint fills a dsfunc template state: names, units, moments, counters, scaler.

DeepSpeed's names are the module's parameter names, as dsfunc's are, so a parameter is matched by name
(any of its tied names) and checked by shape. What lands where:

==========================================  ================================================================
DeepSpeed                                   dsfunc (the keys of :mod:`dsfunc.checkpoint.keys`)
==========================================  ================================================================
fp32 master (or the fp32 module, stage 0)   ``params/<unit>``: this rank's ``torch.chunk`` slice of the unit
``exp_avg`` / ``exp_avg_sq``                ``optim/.../adam/mu/<unit>`` / ``.../nu/<unit>`` (ScaleByAdamState)
the torch optimizer's ``step``              ``optim/.../adam/count``
``lr_scheduler.last_batch_iteration`` = t   ``optim/.../lr/count`` = t + 1 (the k-th applied step uses t = k-1)
a torch scheduler's ``last_epoch`` = k      ``optim/.../lr/count`` = k
fp16 ``DynamicLossScaler``                  ``scaler/*`` (fp16 with a dynamic scale on both sides only)
``global_steps``                            ``step``
module buffers, frozen parameters           ``buffers/<name>``
==========================================  ================================================================

The dropout seed and the metrics stay the template's (DeepSpeed saves neither). A tensor-parallel template
matches the checkpoint's global shapes; each of its split parameters is read whole and this tp rank's part
sliced out (:meth:`dsfunc.parallel.tensor.TensorParallel.local_part`), whatever tp the checkpoint was saved at.
An expert-parallel template matches the checkpoint's experts by their names in the whole model
(:func:`dsfunc.checkpoint.per_param.whole_params`); each rank reads its own experts (AutoEP's stacked ones: its
dim-0 slice of each), whatever ep DeepSpeed saved at.

[Note: a unit at a time]
The template is filled one unit at a time: for each unit, host staging buffers of this rank's slice (one
per quantity read) are filled from the shards that hold pieces of it (:meth:`.shards.ShardIndex.read`,
one shard file open at a time), then copied into the template's tensors and freed. So besides the
template itself the import holds one unit's slice of the master weights and moments, never the model;
:data:`IMPORT_STATS` records the most it held.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from dsfunc.checkpoint.compat import Selection, differences
from dsfunc.checkpoint.deepspeed.contents import DeepSpeedCheckpoint
from dsfunc.checkpoint.deepspeed.shards import EXP_AVG, EXP_AVG_SQ, MASTER, Request
from dsfunc.checkpoint.errors import CheckpointMismatchError
from dsfunc.checkpoint.keys import entries
from dsfunc.checkpoint.metadata import precision
from dsfunc.checkpoint.per_param import part, whole_params
from dsfunc.optim.from_config import lr_schedule
from dsfunc.optim.transforms import ScaleByAdamState, ScheduleState
from dsfunc.parallel.tensor import TensorParallel
from dsfunc.state import TrainState
from dsfunc.zero.layout import ParamSlot


@dataclasses.dataclass
class ImportStats:
    """Elements of DeepSpeed tensor data held in staging buffers: now, and the most at once."""

    live: int = 0
    max_elements: int = 0

    def staged(self, n: int) -> None:
        self.live += n
        self.max_elements = max(self.max_elements, self.live)

    def freed(self, n: int) -> None:
        self.live -= n


IMPORT_STATS = ImportStats()


@dataclasses.dataclass(frozen=True)
class ImportPlan:
    """What a load takes from the checkpoint, decided (and checked) before the template is touched."""

    names: dict[str, str]  # the template's parameter and buffer names -> DeepSpeed's
    parts: frozenset[str]  # Selection.parts()
    adams: tuple[ScaleByAdamState, ...]  # the template's moments to fill (one per parameter group); () keeps them
    schedules: tuple[ScheduleState, ...]  # the template's lr positions to set
    scaler: bool  # take the loss scaler's state


def plan_import(ckpt: DeepSpeedCheckpoint, state: TrainState, selection: Selection) -> ImportPlan:
    """Check ``ckpt`` against the template; raise :class:`CheckpointMismatchError` naming what differs."""
    parts = frozenset(selection.parts())
    names = _match_names(ckpt, state)
    adams = _adam_states(ckpt, state) if "optimizer" in parts else ()
    schedules: tuple[ScheduleState, ...] = ()
    if "schedule" in parts:
        found = optree.tree_leaves(state.opt_state, is_leaf=lambda x: isinstance(x, ScheduleState))
        schedules = tuple(x for x in found if isinstance(x, ScheduleState))
        if ckpt.schedule is not None and _applied_steps(ckpt.schedule) is None:
            raise CheckpointMismatchError(
                f"the lr scheduler state in {ckpt.files.main} ({sorted(ckpt.schedule)}) is neither one of "
                "DeepSpeed's schedulers nor a torch lr scheduler, whose position dsfunc reads; pass "
                "load_lr_scheduler_states=False to start this state's schedule afresh")
    program = state.program
    scaler = ("scaler" in parts and ckpt.scaler is not None and ckpt.scaler.dynamic and ckpt.precision == "fp16"
              and precision(state) == "fp16" and program.scaler.dynamic)
    return ImportPlan(names, parts, adams, schedules, scaler)


def _applied_steps(schedule: Any) -> int | None:
    """The optimizer steps a saved scheduler has followed: DeepSpeed's ``last_batch_iteration`` t (t + 1),
    or a torch scheduler's ``last_epoch`` (a client scheduler DeepSpeed saved); None for anything else."""
    if "last_batch_iteration" in schedule:
        return int(schedule["last_batch_iteration"]) + 1
    if "last_epoch" in schedule and "base_lrs" in schedule:
        return int(schedule["last_epoch"])
    return None


def _match_names(ckpt: DeepSpeedCheckpoint, state: TrainState) -> dict[str, str]:
    """Template name -> DeepSpeed name of every parameter and persistent buffer, or the differences."""
    program, index = state.program, ckpt.index
    canonical: dict[str, str] = {}
    mine: dict[str, tuple[int, ...]] = {}
    for unit in program.plan.units:  # a tp state's split parameters, an ep state's experts: the whole model's
        for name, shape, aliases in whole_params(state, unit):
            mine[name] = shape
            canonical.update({alias: name for alias in aliases})
    for name in program.plan.frozen:
        mine[name] = tuple(state.buffers[name].shape)
        canonical[name] = name
    saved, names = {}, {}
    for ds_name, shape in {**index.trainable, **index.frozen}.items():
        name = next((canonical[a] for a in index.aliases.get(ds_name, (ds_name,)) if a in canonical), ds_name)
        saved[name], names[name] = tuple(shape), ds_name
    kept = [n for n in program.persistent_buffers if n not in program.plan.frozen]
    mine.update({f"{n} (buffer)": tuple(state.buffers[n].shape) for n in kept})
    saved.update({f"{n} (buffer)": tuple(shape) for n, (shape, _) in index.buffers.items()})
    names.update({n: n for n in kept})
    lines = differences(saved, mine, "the model")
    if lines:
        raise CheckpointMismatchError(
            f"the DeepSpeed checkpoint {ckpt.folder} does not match this model:\n" + "\n".join(lines)
            + "\nBuild the template state from the model DeepSpeed trained.")
    return names


def _adam_states(ckpt: DeepSpeedCheckpoint, state: TrainState) -> tuple[ScaleByAdamState, ...]:
    """The template's Adam states (one per parameter group, each over its own units), which the checkpoint's
    moments fill by parameter name; an error if either side lacks them."""
    found = optree.tree_leaves(state.opt_state, is_leaf=lambda x: isinstance(x, ScaleByAdamState))
    adams = [x for x in found if isinstance(x, ScaleByAdamState)]
    ours = {id(t) for a in adams for t in (a.count, *a.mu.values(), *a.nu.values())}
    other = [e.key for e in entries(state) if e.part == "optimizer" and id(e.tensor) not in ours]
    cfg = state.program.config
    mine = cfg.optimizer.type if cfg.optimizer is not None else "a custom transform"
    hint = ("pass load_optimizer_states=False to take everything else and start this optimizer fresh (its lr "
            "schedule restarts too)")
    if not adams or other:
        raise CheckpointMismatchError(
            f"this state's optimizer ({mine!r}) keeps {other or 'no Adam moments'}, which the Adam moments of "
            f"the DeepSpeed checkpoint {ckpt.folder} ({ckpt.optimizer}) cannot fill: use Adam or AdamW, or "
            + hint)
    if ckpt.moments is False:
        raise CheckpointMismatchError(
            f"the DeepSpeed checkpoint {ckpt.folder} holds no Adam moments ({ckpt.optimizer}) for this state's "
            f"{mine!r}: " + hint)
    return tuple(adams)


def fill(ckpt: DeepSpeedCheckpoint, state: TrainState, plan: ImportPlan) -> None:
    """Write the checkpoint into the template's tensors, in place ([Note: a unit at a time])."""
    quantities: dict[str, Any] = {}
    if "params" in plan.parts:
        quantities[MASTER] = state.params
    if plan.adams:  # each unit's moments live in its group's Adam state
        quantities.update({EXP_AVG: {u: t for a in plan.adams for u, t in a.mu.items()},
                           EXP_AVG_SQ: {u: t for a in plan.adams for u, t in a.nu.items()}})
    if quantities:
        for unit in state.program.plan.units:
            _fill_unit(ckpt, state, unit, quantities, plan.names)
    if "buffers" in plan.parts:
        _fill_buffers(ckpt, state, plan.names)
    _fill_counters(ckpt, state, plan)


@torch.no_grad()
def _fill_unit(ckpt: DeepSpeedCheckpoint, state: TrainState, unit: Any, quantities: dict[str, Any],
               names: dict[str, str]) -> None:
    plan, tensor = state.program.plan, state.program.tensor
    start, stop = plan.local_range(unit)
    staging = {q: torch.empty(stop - start, dtype=torch.float32) for q in quantities}
    elements = (stop - start) * len(staging)
    IMPORT_STATS.staged(elements)
    try:
        requests = []
        for slot in unit.params:
            lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
            if lo < hi:
                views = {q: s[lo - start : hi - start] for q, s in staging.items()}
                where = part(state, unit, slot)  # an expert: its place in the whole model
                # tp-split or an ep slice, never both: init_state refuses a tp plan that splits AutoEP's experts
                tp_split = tensor is not None and slot.name in tensor.split
                # AutoEP's stacked experts: this ep rank's dim-0 slice, one run of the whole flattened tensor
                base = where.group.rank * slot.numel if where.placements is not None and not tp_split else 0
                request = Request(names[where.name], base + lo - slot.offset, base + hi - slot.offset, views)
                if tp_split:
                    _read_split(ckpt, tensor, slot, request)
                else:
                    requests.append(request)
        ckpt.index.read(requests)
        for q, tensors in quantities.items():
            target = tensors[unit.name]
            target[: stop - start].copy_(staging[q])
            target[stop - start :].zero_()  # the padding tail stays zero
    finally:
        IMPORT_STATS.freed(elements)


def _read_split(ckpt: DeepSpeedCheckpoint, tensor: TensorParallel, slot: ParamSlot, request: Request) -> None:
    """Fill ``request`` (elements of ``slot``'s tp-local part) from the whole parameter, read one quantity at a
    time (it stays held while read: the staging of one global parameter), and this rank's part of it sliced out."""
    whole = torch.empty(tensor.split[slot.name].shape, dtype=torch.float32)
    IMPORT_STATS.staged(whole.numel())
    try:
        for quantity, view in request.views.items():
            ckpt.index.read([Request(request.name, 0, whole.numel(), {quantity: whole.view(-1)})])
            part = tensor.local_part(slot.name, whole).reshape(-1)
            view.copy_(part[request.lo : request.hi])
    finally:
        IMPORT_STATS.freed(whole.numel())


@torch.no_grad()
def _fill_buffers(ckpt: DeepSpeedCheckpoint, state: TrainState, names: dict[str, str]) -> None:
    """Persistent buffers and frozen parameters, one at a time (non-persistent ones stay the template's)."""
    for name, target in state.buffers.items():
        if name not in names:
            continue
        staging = torch.empty(target.numel(), dtype=target.dtype)
        IMPORT_STATS.staged(staging.numel())
        try:
            ckpt.index.read([Request(names[name], 0, staging.numel(), {MASTER: staging})])
            target.copy_(staging.view(target.shape))
        finally:
            IMPORT_STATS.freed(staging.numel())


@torch.no_grad()
def _fill_counters(ckpt: DeepSpeedCheckpoint, state: TrainState, plan: ImportPlan) -> None:
    if "step" in plan.parts:
        state.step.fill_(ckpt.global_steps)
    for adam in plan.adams:
        adam.count.fill_(ckpt.adam_step)
    if plan.schedules:
        applied = _applied_steps(ckpt.schedule) if ckpt.schedule is not None else None
        count = ckpt.adam_step if applied is None else applied
        schedule = lr_schedule(state.program.config)
        for s in plan.schedules:
            s.count.fill_(count)
            if schedule is not None:  # the lr the last applied step used (before any: the first one's)
                s.lr.copy_(schedule(torch.tensor(max(count, 1) - 2)))
    if plan.scaler:
        saved, scaler = ckpt.scaler, state.scaler
        scaler.scale.fill_(saved.scale)
        scaler.cur_iter.fill_(saved.cur_iter if saved.cur_iter is not None else ckpt.global_steps)
        if saved.last_overflow_iter is not None:
            scaler.last_overflow_iter.fill_(saved.last_overflow_iter)
        if saved.cur_hysteresis is not None:
            scaler.cur_hysteresis.fill_(saved.cur_hysteresis)

