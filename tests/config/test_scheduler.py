"""The scheduler section: types and DeepSpeed's defaults for their params."""

from __future__ import annotations

import pytest

from dsfunc.config import SchedulerConfig
from tests.config.helpers import error, load

SCHEDULER_DEFAULTS = [
    (
        "WarmupLR",
        {},
        {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": None,
            "warmup_num_steps": 1000,
            "warmup_type": "log",
            "last_batch_iteration": -1,
        },
    ),
    (
        "WarmupDecayLR",
        {"total_num_steps": 5000},
        {
            "total_num_steps": 5000,
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.001,
            "warmup_num_steps": 1000,
            "warmup_type": "log",
            "last_batch_iteration": -1,
        },
    ),
    (
        "WarmupCosineLR",
        {"total_num_steps": 5000},
        {
            "total_num_steps": 5000,
            "warmup_min_ratio": 0.0,
            "warmup_num_steps": 1000,
            "cos_min_ratio": 0.0001,
            "warmup_type": "log",
            "last_batch_iteration": -1,
        },
    ),
    (
        "OneCycle",
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1},
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "decay_lr_rate": 0.0,
            "cycle_first_step_size": 2000,
            "cycle_second_step_size": 2000,
            "cycle_first_stair_count": 0,
            "cycle_second_stair_count": 0,
            "decay_step_size": 0,
            "cycle_momentum": True,
            "cycle_min_mom": 0.8,
            "cycle_max_mom": 0.9,
            "decay_mom_rate": 0.0,
            "last_batch_iteration": -1,
        },
    ),
    (
        "LRRangeTest",
        {},
        {
            "lr_range_test_min_lr": 1e-3,
            "lr_range_test_step_size": 2000,
            "lr_range_test_step_rate": 1.0,
            "lr_range_test_staircase": False,
            "last_batch_iteration": -1,
        },
    ),
]


@pytest.mark.parametrize("kind, params, expected", SCHEDULER_DEFAULTS)
def test_scheduler_defaults(kind, params, expected):
    sched = load({"scheduler": {"type": kind, "params": params}}).scheduler
    assert sched == SchedulerConfig(kind, expected)
    assert load({"scheduler": {"type": kind.lower(), "params": params}}).scheduler.type == kind


def test_one_cycle_second_phase_follows_first_unless_given():
    params = {
        "cycle_min_lr": 0.01,
        "cycle_max_lr": 0.1,
        "cycle_first_step_size": 10,
        "cycle_first_stair_count": 2,
    }
    p = load({"scheduler": {"type": "OneCycle", "params": params}}).scheduler.params
    assert (p["cycle_second_step_size"], p["cycle_second_stair_count"]) == (10, 2)
    p = load(
        {"scheduler": {"type": "OneCycle", "params": {**params, "cycle_second_step_size": 30}}}
    ).scheduler.params
    assert p["cycle_second_step_size"] == 30


def test_a_schedule_position_is_refused_where_the_config_is_read():
    message = error({"train_batch_size": 8,
                     "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 10}}})
    assert message.startswith("scheduler.params.last_batch_iteration = 10 is not supported")
    assert "load_checkpoint" in message
