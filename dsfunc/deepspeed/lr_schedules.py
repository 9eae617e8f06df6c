"""``deepspeed.runtime.lr_schedules``: DeepSpeed's lr schedule classes, which dsfunc runs from a config's
``scheduler`` section (:mod:`dsfunc.schedules`).

What ``initialize`` returns as ``lr_scheduler`` for a config section is the engine's schedule view
(:class:`~dsfunc.deepspeed.views.EngineLRScheduler`) as an instance of the class the section names, so
``isinstance(lr_scheduler, WarmupLR)`` holds as with DeepSpeed. Libraries check a scheduler's class name against
:data:`VALID_LR_SCHEDULES` to tell DeepSpeed's own schedulers (which the engine steps) from torch's.

Built by hand on a torch optimizer (``WarmupLR(optimizer, warmup_num_steps=...)``), each is DeepSpeed's scheduler:
``step()`` writes the lr (and OneCycle's momentum) of each parameter group into the optimizer, computed by the
same :mod:`dsfunc.schedules` function as a config section of that type (one section per group, since DeepSpeed
takes a list per group for its lr and momentum params).
"""

from __future__ import annotations

from typing import Any

import torch

from dsfunc.config.scheduler import SCHEDULER_NAMES, parse_scheduler, scheduler_arguments
from dsfunc.deepspeed.namespace import other_name
from dsfunc.deepspeed.views import EngineLRScheduler, Viewed
from dsfunc.errors import InputError, InputTypeError, UsageError
from dsfunc.optim.from_config import momentum_schedule_from_config, schedule_from_config
from dsfunc.schedules import Schedule, one_cycle_momentum

VALID_LR_SCHEDULES = list(SCHEDULER_NAMES)  # the config's scheduler types: DeepSpeed's class names
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# the names of the sections' params, as scripts build configs with them
LR_SCHEDULE, TOTAL_NUM_STEPS, EDGE_VALUE, MID_VALUE = "lr_schedule", "total_num_steps", "edge_value", "mid_value"
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
CYCLE_FIRST_STEP_SIZE, CYCLE_SECOND_STEP_SIZE = "cycle_first_step_size", "cycle_second_step_size"
CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STAIR_COUNT = "cycle_first_stair_count", "cycle_second_stair_count"
CYCLE_MIN_LR, CYCLE_MAX_LR, CYCLE_MIN_MOM, CYCLE_MAX_MOM = "cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"
DECAY_STEP_SIZE, DECAY_LR_RATE, DECAY_MOM_RATE = "decay_step_size", "decay_lr_rate", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE, WARMUP_MIN_RATIO, COS_MIN_RATIO = "log", "linear", "warmup_min_ratio", "cos_min_ratio"


class ConfigScheduler(EngineLRScheduler):
    """DeepSpeed's scheduler class: built on a torch optimizer, its own stepped schedule; made by :meth:`of`,
    the engine's view of its config ``scheduler`` section."""

    _optimizer: torch.optim.Optimizer | None = None  # set when built by hand
    _ratio: Schedule | None = None  # a hand-built WarmupCosineLR's

    def __init__(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputTypeError(f"{name}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        names = scheduler_arguments(name)
        if len(args) > len(names):
            raise InputTypeError(f"{name} takes at most {len(names)} arguments after the optimizer, got {len(args)}")
        params = dict(zip(names, args))
        for key in kwargs.keys() & params.keys():
            raise InputTypeError(f"{name}: {key} given twice")
        params.update(kwargs)
        start = params.pop("last_batch_iteration", -1)
        groups = optimizer.param_groups
        sections = _per_group(name, params, groups)
        self._optimizer, self.params = optimizer, params
        self._lrs = [schedule_from_config(name, p, _plain(g["lr"])) for p, g in zip(sections, groups)]
        cycles = name == ONE_CYCLE and params.get("cycle_momentum", True) and "betas" in optimizer.defaults
        self._moms: list[Schedule] | None = [momentum_schedule_from_config(name, p) for p in sections] if cycles else None
        self._reported_moms = [_reported_mom(p) for p in sections] if cycles else None
        if name != WARMUP_COSINE_LR and name != LR_RANGE_TEST:  # DeepSpeed's per-group bounds
            low, high = ("cycle_min_lr", "cycle_max_lr") if name == ONE_CYCLE else ("warmup_min_lr", "warmup_max_lr")
            parsed = [parse_scheduler({"type": name, "params": p}).params for p in sections]
            self.min_lrs = [p[low] for p in parsed]
            self.max_lrs = [_plain(g["lr"]) if p[high] is None else p[high] for p, g in zip(parsed, groups)]
        # WarmupCosineLR's ratio of each group's lr (its params are one value for every group)
        if name == WARMUP_COSINE_LR:
            self._ratio = schedule_from_config(name, params, 1.0)
        self._last_lr: list[Any] | None = None
        self._t = start
        if start == -1:
            self._write()
            if name == ONE_CYCLE:  # DeepSpeed's OneCycle writes the lr but has no last lr before its first step()
                self._last_lr = None

    @classmethod
    def of(cls, engine: Viewed) -> ConfigScheduler:
        view = cls.__new__(cls)
        EngineLRScheduler.__init__(view, engine)
        return view

    def __getattr__(self, key: str) -> Any:
        """A hand-built scheduler's params read as DeepSpeed's attributes (``warmup_type``, ...)."""
        params = self.__dict__.get("params")
        if params is not None and key in params:
            return params[key]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    @property
    def last_batch_iteration(self) -> int:
        return super().last_batch_iteration if self._optimizer is None else self._t

    @last_batch_iteration.setter
    def last_batch_iteration(self, value: int) -> None:
        self._own("set last_batch_iteration")
        self._t = int(value)

    def get_lr(self) -> list[float]:
        if self._optimizer is None:
            return super().get_lr()
        return [_at(s, self._t) for s in self._lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """OneCycle's ``betas`` per group at the counter (None when it does not cycle momentum)."""
        if self._optimizer is not None:
            return None if self._moms is None else [(_at(s, self._t), 0.99) for s in self._reported_moms]
        cfg = self._engine.state.program.config
        cycles = cfg.scheduler is not None and cfg.scheduler.type == ONE_CYCLE and cfg.scheduler.params[
            "cycle_momentum"] and cfg.optimizer is not None and "betas" in cfg.optimizer.params
        if not cycles:
            return None
        mom = _at(_reported_mom(cfg.scheduler.params), self.last_batch_iteration)
        return [(mom, 0.99) for _ in self._engine.groups]

    def get_lr_ratio(self) -> float:
        """WarmupCosineLR's factor on each group's lr at the counter."""
        if self._ratio is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'get_lr_ratio'")
        return _at(self._ratio, self._t)

    def get_last_lr(self) -> list[Any]:
        if self._optimizer is None:
            return super().get_last_lr()
        if self._last_lr is None:
            raise UsageError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return self._last_lr

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance to ``batch_iteration`` (default: the next one) and write its lr into the optimizer."""
        if self._optimizer is None:  # the engine's view: its one message
            return super().step(*args, **kwargs)
        given = args[0] if args else next(iter(kwargs.values()), None)
        self._t = self._t + 1 if given is None else int(given)
        self._write()

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._own("load_state_dict()")
        self._t = int(state_dict["last_batch_iteration"])

    def _own(self, what: str) -> None:
        if self._optimizer is None:
            raise UsageError(f"{what} on the engine's lr_scheduler: the engine advances its schedule in engine.step()")

    def _write(self) -> None:
        """DeepSpeed's update: each group's lr (in place when a tensor) and, cycling, its betas."""
        groups = self._optimizer.param_groups
        for group, lr in zip(groups, self.get_lr()):
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        for group, mom in zip(groups, self._moms or ()):
            group["betas"] = (_at(mom, self._t), 0.99)
        self._last_lr = [g["lr"] for g in groups]


_PER_GROUP = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom",
              "lr_range_test_min_lr")  # DeepSpeed takes a value or a list of one per group


def _per_group(name: str, params: dict[str, Any], groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The params as one config section per parameter group."""
    out = [dict(params) for _ in groups]
    for key in _PER_GROUP:
        value = params.get(key)
        if isinstance(value, (list, tuple)):
            if len(value) != len(groups):
                raise InputError(f"{name}: {key} has {len(value)} values, the optimizer {len(groups)} param groups; "
                                 "give one per group or a single value")
            for section, v in zip(out, value):
                section[key] = v
    return out


def _reported_mom(params: dict[str, Any]) -> Schedule:
    """OneCycle's momentum as DeepSpeed's ``get_mom()`` reports it."""
    parsed = parse_scheduler({"type": ONE_CYCLE, "params": params}).params
    return one_cycle_momentum(**{k: v for k, v in parsed.items() if k != "last_batch_iteration"}, reported=True)


def _plain(lr: Any) -> float:
    return float(lr.item()) if torch.is_tensor(lr) else float(lr)


def _at(schedule: Schedule, t: int) -> float:
    """The schedule's value at DeepSpeed's counter ``t``, in float64 as DeepSpeed computes it."""
    return float(schedule(torch.tensor(t, dtype=torch.float64)))


def _scheduler(name: str) -> type[ConfigScheduler]:
    return type(name, (ConfigScheduler,), {"__doc__": f"DeepSpeed's {name}: the engine's view of a config "
                                           f'"scheduler" section of type {name}.', "__module__": __name__})


LRRangeTest = _scheduler(LR_RANGE_TEST)
OneCycle = _scheduler(ONE_CYCLE)
WarmupLR = _scheduler(WARMUP_LR)
WarmupDecayLR = _scheduler(WARMUP_DECAY_LR)
WarmupCosineLR = _scheduler(WARMUP_COSINE_LR)
_BY_NAME = {cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)}


def hand_built(scheduler: Any) -> bool:
    """Whether ``scheduler`` is one of these classes built on a torch optimizer (which the engine steps, as a client's
    torch scheduler), not the engine's view."""
    return isinstance(scheduler, ConfigScheduler) and scheduler.optimizer is not None


def engine_scheduler(engine: Viewed, section_type: str | None) -> EngineLRScheduler:
    """The view of ``engine``'s schedule: an instance of the config section's class when it names one."""
    cls = _BY_NAME.get(section_type) if section_type is not None else None
    return cls.of(engine) if cls is not None else EngineLRScheduler(engine)


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.lr_schedules`` import, and refuse when used."""
    return other_name("runtime.lr_schedules", name)
