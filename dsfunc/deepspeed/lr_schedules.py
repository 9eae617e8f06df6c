"""``deepspeed.runtime.lr_schedules``: the names of DeepSpeed's lr schedules, which dsfunc runs from a
config's ``scheduler`` section (:mod:`dsfunc.schedules`).

Libraries check a scheduler's class name against :data:`VALID_LR_SCHEDULES` to tell DeepSpeed's own
schedulers (which the engine steps) from torch's. DeepSpeed's scheduler classes, built by hand on an
optimizer, are not dsfunc's way: describe the schedule in the config instead.
"""

from typing import Any

from dsfunc.config.scheduler import SCHEDULER_NAMES
from dsfunc.deepspeed.namespace import other_name
from dsfunc.errors import unsupported

VALID_LR_SCHEDULES = list(SCHEDULER_NAMES)  # the config's scheduler types: DeepSpeed's class names
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

# DeepSpeed's names of the schedules' params, which scripts use as the keys of a config's "scheduler.params"
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = (
    "lr_range_test_min_lr", "lr_range_test_step_rate", "lr_range_test_step_size", "lr_range_test_staircase")
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = (
    "cycle_first_step_size", "cycle_first_stair_count", "cycle_second_step_size", "cycle_second_stair_count")
DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = (
    "decay_step_size", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate")
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE = (
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"

_HINT = 'describe it in the config\'s "scheduler" section: {"type": "%s", "params": {...}}'
LRRangeTest = unsupported("deepspeed.runtime.lr_schedules.LRRangeTest", "a hand-built DeepSpeed scheduler",
                          _HINT % LR_RANGE_TEST)
OneCycle = unsupported("deepspeed.runtime.lr_schedules.OneCycle", "a hand-built DeepSpeed scheduler",
                       _HINT % ONE_CYCLE)
WarmupLR = unsupported("deepspeed.runtime.lr_schedules.WarmupLR", "a hand-built DeepSpeed scheduler",
                       _HINT % WARMUP_LR)
WarmupDecayLR = unsupported("deepspeed.runtime.lr_schedules.WarmupDecayLR", "a hand-built DeepSpeed scheduler",
                            _HINT % WARMUP_DECAY_LR)
WarmupCosineLR = unsupported("deepspeed.runtime.lr_schedules.WarmupCosineLR", "a hand-built DeepSpeed scheduler",
                             _HINT % WARMUP_COSINE_LR)


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.lr_schedules`` import, and refuse when used."""
    return other_name("runtime.lr_schedules", name)
