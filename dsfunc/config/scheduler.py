"""The ``scheduler`` section: which LR schedule, with DeepSpeed's defaults for its params."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import (
    _LR,
    _NON_NEGATIVE,
    _STEPS,
    _bool,
    _canonical_type,
    _choice,
    _integer,
    _number,
    _optional,
)
from dsfunc.config.errors import ConfigError
from dsfunc.config.schema import _REQUIRED, _TYPE_AND_PARAMS, _parse, _Schema, _Spec, _TypedSection


@dataclass(frozen=True)
class SchedulerConfig(_TypedSection):
    """``scheduler``: canonical ``type`` (DeepSpeed's class name) and its complete, validated ``params``."""


SCHEDULER_NAMES = {  # DeepSpeed's scheduler class names (deepspeed.runtime.lr_schedules)
    name: name for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
}
def _fresh_iteration(value: Any, path: str) -> int:
    """``last_batch_iteration``: an integer >= -1, and only -1 is supported (the state holds the position)."""
    value = _integer(ge=-1)(value, path)
    if value != -1:
        raise ConfigError(
            f"{path} = {value} is not supported; dsfunc keeps the schedule's position in the training state, "
            "so resume with dsfunc.load_checkpoint and leave last_batch_iteration at -1"
        )
    return value


_LAST_ITERATION = _Spec(-1, _fresh_iteration)
_WARMUP_STEPS = _Spec(1000, _STEPS)
_WARMUP_TYPE = _Spec("log", _choice("log", "linear"))
_TOTAL_STEPS = _Spec(_REQUIRED, _STEPS)
_SCHEDULER_PARAMS = {
    "WarmupLR": {
        "warmup_min_lr": _Spec(0.0, _LR),
        "warmup_max_lr": _Spec(None, _optional(_LR)),
        "warmup_num_steps": _WARMUP_STEPS,
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _LAST_ITERATION,
    },
    "WarmupDecayLR": {
        "total_num_steps": _TOTAL_STEPS,
        "warmup_min_lr": _Spec(0.0, _LR),
        "warmup_max_lr": _Spec(0.001, _LR),
        "warmup_num_steps": _WARMUP_STEPS,
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _LAST_ITERATION,
    },
    "WarmupCosineLR": {
        "total_num_steps": _TOTAL_STEPS,
        "warmup_min_ratio": _Spec(0.0, _NON_NEGATIVE),
        "warmup_num_steps": _WARMUP_STEPS,
        "cos_min_ratio": _Spec(0.0001, _NON_NEGATIVE),
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _LAST_ITERATION,
    },
    "OneCycle": {
        "cycle_min_lr": _Spec(_REQUIRED, _LR),
        "cycle_max_lr": _Spec(_REQUIRED, _LR),
        "decay_lr_rate": _Spec(0.0, _NON_NEGATIVE),
        "cycle_first_step_size": _Spec(2000, _STEPS),
        "cycle_second_step_size": _Spec(None, _optional(_STEPS)),
        "cycle_first_stair_count": _Spec(0, _integer(ge=0)),
        "cycle_second_stair_count": _Spec(None, _optional(_integer(ge=0))),
        "decay_step_size": _Spec(0, _integer(ge=0)),
        "cycle_momentum": _Spec(True, _bool),
        "cycle_min_mom": _Spec(0.8, _number(ge=0.0, lt=1.0)),
        "cycle_max_mom": _Spec(0.9, _number(ge=0.0, lt=1.0)),
        "decay_mom_rate": _Spec(0.0, _NON_NEGATIVE),
        "last_batch_iteration": _LAST_ITERATION,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": _Spec(1e-3, _LR),
        "lr_range_test_step_size": _Spec(2000, _STEPS),
        "lr_range_test_step_rate": _Spec(1.0, _NON_NEGATIVE),
        "lr_range_test_staircase": _Spec(False, _bool),
        "last_batch_iteration": _LAST_ITERATION,
    },
}
_SCHEDULER_SECTION = _Schema(specs=_TYPE_AND_PARAMS)


def _scheduler(value: Any, path: str) -> SchedulerConfig:
    section = _parse(value, path, _SCHEDULER_SECTION)
    kind = _canonical_type(section["type"], f"{path}.type", SCHEDULER_NAMES, "LR scheduler")
    params = _parse(
        section["params"], f"{path}.params", _Schema(_SCHEDULER_PARAMS[kind], what=f'scheduler "{kind}"')
    )
    if "total_num_steps" in params and params["total_num_steps"] < params["warmup_num_steps"]:
        raise ConfigError(
            f"{path}.params.total_num_steps = {params['total_num_steps']} is smaller than warmup_num_steps = "
            f"{params['warmup_num_steps']} (default 1000 when not set): the schedule would end inside the "
            f"warmup. Set warmup_num_steps <= total_num_steps."
        )
    if kind == "OneCycle":
        for phase in ("step_size", "stair_count"):
            if params[f"cycle_second_{phase}"] is None:
                params[f"cycle_second_{phase}"] = params[f"cycle_first_{phase}"]
    return SchedulerConfig(kind, params)


def scheduler_arguments(kind: str) -> list[str]:
    """The params of DeepSpeed's scheduler class ``kind`` in the order its constructor takes them."""
    return list(_SCHEDULER_PARAMS[kind])


def parse_scheduler(section: Any) -> SchedulerConfig:
    """A DeepSpeed ``scheduler`` section (``{"type": ..., "params": {...}}``), validated and completed with
    DeepSpeed's defaults as inside a whole config."""
    return _scheduler(section, "scheduler")
