"""What :func:`~dsfunc.deepspeed.initialize` returns as ``optimizer`` and ``lr_scheduler`` where DeepSpeed returns
its own objects (not the client's): views of the engine's update, one entry per parameter group, so scripts that
read ``param_groups`` or ``get_last_lr()`` keep working."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import optree
import torch

from dsfunc.errors import InputError, UsageError
from dsfunc.optim.from_config import LrSchedule, group_section, lr_schedule_of
from dsfunc.optim.groups import ParamGroups, plain
from dsfunc.optim.muon import muon_groups
from dsfunc.optim.torch_optimizer import TorchOptimizerUpdate
from dsfunc.optim.transforms import ScheduleState
from dsfunc.schedules import Schedule
from dsfunc.state import TrainState
from dsfunc.zero.placeholders import full_shape


class Viewed(Protocol):
    """What the views read of the engine (a protocol, so this module need not import the engine's)."""

    groups: list[GroupView]

    @property
    def state(self) -> TrainState: ...

    def get_lr(self) -> list[float]: ...

    def scheduled_lr(self) -> list[float]: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


def schedule_count(opt_state: Any) -> torch.Tensor:
    """Applied steps so far, from the learning-rate state of the update."""
    for node in optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleState)):
        if isinstance(node, ScheduleState):
            return node.count
    raise InputError("the optimizer state holds no learning-rate state")


@dataclasses.dataclass(frozen=True)
class GroupView:
    """One parameter group as the engine's optimizer shows it: its label (``None``: the only group), its
    optimizer params, its own lr and schedule, and the module's parameters in it."""

    label: str | None
    hyper: dict[str, Any]
    lr: float
    schedule: Schedule | None
    params: list[torch.Tensor]

    def lr_at(self, t: torch.Tensor) -> float:
        """The lr at DeepSpeed's schedule counter ``t`` (the k-th applied step uses ``t = k - 1``), in float64 as
        DeepSpeed's schedulers compute it (the step uses it rounded to float32)."""
        return self.lr if self.schedule is None else float(self.schedule(t.to(torch.float64)))


def group_views(state: TrainState, param_groups: ParamGroups | None, schedule_for: LrSchedule | None) -> list[GroupView]:
    """The engine's parameter groups, in order, with what :func:`dsfunc.init_state` made of them."""
    program = state.program
    cfg, plan = program.config, program.plan
    labels = list(dict.fromkeys(u.label for u in plan.units))
    if cfg.optimizer is not None and cfg.optimizer.type == "muon" and not isinstance(program.update,
                                                                                    TorchOptimizerUpdate):
        # the groups init_state trained: each split in a Muon and an Adam half, in DeepSpeed's order
        shapes = {n: tuple(full_shape(p)) for n, p in program.skeleton.named_parameters() if p.requires_grad}
        param_groups = muon_groups(shapes, cfg.optimizer.params, param_groups)
        labels = [label for label in param_groups.options if label in labels] if labels != [None] else labels
    options = param_groups.options if param_groups is not None else {}
    if labels == [None] and param_groups is not None:  # one group: its options went into the plain layout
        first = param_groups.order(n for n, p in program.skeleton.named_parameters() if p.requires_grad)
        options = {None: options.get(first[0], {})} if first else {}
    own = program.update if isinstance(program.update, TorchOptimizerUpdate) else None
    views = []
    for label in labels:
        if own is not None:  # a client optimizer's own step: its groups hold their options
            index = 0 if label is None else int(label[len("group"):])
            group = own.optimizer.param_groups[index]
            hyper = {k: plain(v) for k, v in group.items() if k != "params"}
            lr, schedule = float(group.get("initial_lr", group["lr"])), own.schedules[index]
        else:
            own_options = dict(options.get(label, {}))
            use_muon = own_options.pop("use_muon", None)  # a Muon half's: DeepSpeed's groups carry it too
            section = group_section(cfg.optimizer, own_options, label)
            hyper = {k: plain(v) for k, v in section.params.items()}
            if use_muon is not None:
                hyper["use_muon"] = use_muon
            lr = float(section.params["lr"])
            schedule = schedule_for(lr) if schedule_for is not None else lr_schedule_of(cfg, lr)
        params = [p for u in plan.units if u.label == label for p in program.binding.residents(u.name)]
        views.append(GroupView(label, hyper, lr, schedule, params))
    order = {f"group{i}": i for i in range(len(views))}
    return sorted(views, key=lambda v: order.get(v.label, -1))


class EngineOptimizer:
    """What :func:`initialize` returns as ``optimizer``: a view of the engine's update.

    ``param_groups`` is one persistent dict per parameter group, as a torch optimizer's: its
    hyper-parameters, ``params`` and the ``lr`` the next step uses (a client torch optimizer's own dicts,
    when one was passed to ``initialize``). A client may write that ``lr`` (a torch lr scheduler built on
    this optimizer or on the client's does): the next step then uses it, as DeepSpeed's does; the
    engine's own schedule, where it has one, writes its value again after that step, else the client's lr
    stays. The dicts are brought up to date when read (one device sync after a step). ``zero_grad()`` is
    the engine's; stepping it or saving it is an error that points to the engine.
    """

    def __init__(self, engine: Viewed, param_groups: list[dict[str, Any]] | None = None) -> None:
        """``param_groups``: a client torch optimizer's, translated into the engine's groups (same order),
        kept as the dicts of this view."""
        self._engine = engine
        self.optimizer: torch.optim.Optimizer | None = None  # the client's, as DeepSpeed's wrappers name it
        self.driven = False  # a client's torch lr scheduler writes these dicts' lr: the engine never does
        self._groups = param_groups if param_groups is not None else [
            {**g.hyper, "lr": g.lr, "params": g.params} for g in engine.groups]
        self._written: list[float] = [g.lr for g in engine.groups]  # the lr the engine last put in each dict
        self._fresh_at: int | None = None  # the applied-step count the dicts were last brought up to date at

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        self._refresh()
        return self._groups

    def _refresh(self) -> None:
        """Write the schedule's lr into each dict the client has not written since the engine did."""
        at = int(schedule_count(self._engine.state.opt_state))
        if at == self._fresh_at or self.driven:
            return
        for i, lr in enumerate(self._engine.scheduled_lr()):
            if self._groups[i]["lr"] == self._written[i]:
                self._groups[i]["lr"] = self._written[i] = lr
        self._fresh_at = at

    def step_lr(self) -> dict[str | None, float]:
        """The lr of the step about to be applied, per group label, where the client set it; the groups whose
        lr the engine schedules take the schedule's again after this step."""
        self._refresh()
        out = {}
        for view, group, written in zip(self._engine.groups, self._groups, self._written):
            changed = sorted(k for k, v in view.hyper.items() if k != "lr" and k in group and plain(group[k]) != v)
            if changed:
                raise UsageError(f"param_groups {changed} were changed; dsfunc's engine follows a client's lr only "
                                 "(set the others in the config or the optimizer passed to initialize)")
            if group["lr"] != written or self.driven:
                out[view.label] = float(group["lr"])
        for i, view in enumerate(self._engine.groups):
            if view.schedule is not None:
                self._written[i] = self._groups[i]["lr"]  # consumed: the next refresh writes the schedule's
        return out

    def lrs(self) -> list[float]:
        """The lr each group's next step uses."""
        return [float(g["lr"]) for g in self.param_groups]

    def restore(self, lrs: list[float]) -> None:
        """Set the groups' lr to a checkpoint's (what they held when it was saved)."""
        if len(lrs) != len(self._groups):
            raise InputError(f"the checkpoint holds the lr of {len(lrs)} parameter groups, the engine has "
                             f"{len(self._groups)}")
        self._fresh_at = None
        self._refresh()
        for group, lr in zip(self._groups, lrs):
            group["lr"] = lr

    @property
    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state this rank holds, per unit (a flat partition, as DeepSpeed's ZeRO optimizers key
        theirs), under the keys of dsfunc's checkpoints with the unit's name left out (``optimizer/adam/mu``):
        read-only views of the state's tensors."""
        # DCP and DTensor load on first use: a second of import time
        from dsfunc.checkpoint.keys import entries

        out: dict[str, dict[str, torch.Tensor]] = {}
        for e in entries(self._engine.state):
            if e.part == "optimizer" and e.unit is not None:
                out.setdefault(e.unit, {})[e.key.removeprefix("optim/").removesuffix(f"/{e.unit}")] = e.tensor
        return out

    def fp32_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 master weights of each parameter group, one flat tensor a group (a copy)."""
        state = self._engine.state
        units = state.program.plan.units
        return [torch.cat([state.params[u.name] for u in units if u.label == g.label]) for g in self._engine.groups]

    @property
    def loss_scaler(self) -> LossScalerView:
        """DeepSpeed's ``optimizer.loss_scaler``: the loss scale's settings and its current values."""
        return LossScalerView(self._engine)

    @property
    def dynamic_loss_scale(self) -> bool:
        return self._engine.state.program.scaler.dynamic

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's ``zero_grad`` (nothing to zero: gradients never live on the module's parameters)."""
        self._engine.zero_grad()

    def step(self, closure: Any = None) -> None:
        raise UsageError("call engine.step() (after engine.backward(loss)); it applies the update")

    def state_dict(self) -> dict[str, Any]:
        raise UsageError("the optimizer state is engine.state.opt_state; save it with engine.save_checkpoint")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise UsageError("restore the optimizer state with engine.load_checkpoint")


class LossScalerView:
    """The engine's loss scale under DeepSpeed's loss-scaler names: the rule's settings and the state's values,
    read from the current state when asked (a device sync)."""

    def __init__(self, engine: Viewed) -> None:
        self._engine = engine

    def _rule(self) -> Any:
        return self._engine.state.program.scaler

    def _now(self) -> Any:
        return self._engine.state.scaler

    dynamic = property(lambda self: self._rule().dynamic)
    scale_window = property(lambda self: self._rule().scale_window)
    min_scale = property(lambda self: self._rule().min_scale)
    delayed_shift = property(lambda self: self._rule().delayed_shift)
    consecutive_hysteresis = property(lambda self: self._rule().consecutive_hysteresis)
    raise_error_at_min_scale = property(lambda self: self._rule().raise_error_at_min_scale)
    cur_iter = property(lambda self: int(self._now().cur_iter))
    last_overflow_iter = property(lambda self: int(self._now().last_overflow_iter))
    cur_hysteresis = property(lambda self: int(self._now().cur_hysteresis))
    cur_scale = property(lambda self: float(self._now().scale))
    loss_scale = cur_scale


class EngineLRScheduler:
    """What :func:`initialize` returns as ``lr_scheduler``: a view of the engine's lr schedule.

    The engine advances it in ``engine.step()`` (not on skipped steps); calling ``step()`` here is an error.
    """

    def __init__(self, engine: Viewed) -> None:
        self._engine = engine

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: applied optimizer steps - 1."""
        return int(schedule_count(self._engine.state.opt_state)) - 1

    def get_lr(self) -> list[float]:
        """The lr the next optimizer step uses, per parameter group."""
        return self._engine.get_lr()

    def get_last_lr(self) -> list[float]:
        """DeepSpeed's meaning: the lr the scheduler last set, i.e. the one the next optimizer step uses
        (set at construction already)."""
        return self._engine.get_lr()

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError("the engine advances the lr schedule in engine.step(); remove lr_scheduler.step()")

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}
