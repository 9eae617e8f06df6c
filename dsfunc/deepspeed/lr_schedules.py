"""``deepspeed.runtime.lr_schedules``: DeepSpeed's lr schedule classes, which dsfunc runs from a config's
``scheduler`` section (:mod:`dsfunc.schedules`).

What ``initialize`` returns as ``lr_scheduler`` for a config section is the engine's schedule view
(:class:`~dsfunc.deepspeed.views.EngineLRScheduler`) as an instance of the class the section names, so
``isinstance(lr_scheduler, WarmupLR)`` holds as with DeepSpeed. Libraries check a scheduler's class name against
:data:`VALID_LR_SCHEDULES` to tell DeepSpeed's own schedulers (which the engine steps) from torch's. Built by
hand on an optimizer, these classes are refused: describe the schedule in the config instead.
"""

from __future__ import annotations

from typing import Any

from dsfunc.config.scheduler import SCHEDULER_NAMES
from dsfunc.deepspeed.namespace import other_name
from dsfunc.deepspeed.views import EngineLRScheduler, Viewed
from dsfunc.errors import NotSupportedError

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
    """The engine's view of its config ``scheduler`` section, as the section's DeepSpeed class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        raise NotSupportedError(
            f"deepspeed.runtime.lr_schedules.{name} (a hand-built DeepSpeed scheduler) is not implemented by dsfunc; "
            f'describe it in the config\'s "scheduler" section: {{"type": "{name}", "params": {{...}}}}'
        )

    @classmethod
    def of(cls, engine: Viewed) -> ConfigScheduler:
        view = cls.__new__(cls)
        EngineLRScheduler.__init__(view, engine)
        return view


def _scheduler(name: str) -> type[ConfigScheduler]:
    return type(name, (ConfigScheduler,), {"__doc__": f"DeepSpeed's {name}: the engine's view of a config "
                                           f'"scheduler" section of type {name}.', "__module__": __name__})


LRRangeTest = _scheduler(LR_RANGE_TEST)
OneCycle = _scheduler(ONE_CYCLE)
WarmupLR = _scheduler(WARMUP_LR)
WarmupDecayLR = _scheduler(WARMUP_DECAY_LR)
WarmupCosineLR = _scheduler(WARMUP_COSINE_LR)
_BY_NAME = {cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)}


def engine_scheduler(engine: Viewed, section_type: str | None) -> EngineLRScheduler:
    """The view of ``engine``'s schedule: an instance of the config section's class when it names one."""
    cls = _BY_NAME.get(section_type) if section_type is not None else None
    return cls.of(engine) if cls is not None else EngineLRScheduler(engine)


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.lr_schedules`` import, and refuse when used."""
    return other_name("runtime.lr_schedules", name)
