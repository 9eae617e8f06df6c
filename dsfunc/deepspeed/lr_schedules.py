"""``deepspeed.runtime.lr_schedules``: the names of DeepSpeed's lr schedules, which dsfunc runs from a
config's ``scheduler`` section (:mod:`dsfunc.schedules`).

Libraries check a scheduler's class name against :data:`VALID_LR_SCHEDULES` to tell DeepSpeed's own
schedulers (which the engine steps) from torch's. DeepSpeed's scheduler classes, built by hand on an
optimizer, are not dsfunc's way: describe the schedule in the config instead.
"""

from dsfunc.config.scheduler import SCHEDULER_NAMES
from dsfunc.errors import unsupported

VALID_LR_SCHEDULES = list(SCHEDULER_NAMES)  # the config's scheduler types: DeepSpeed's class names
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

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
