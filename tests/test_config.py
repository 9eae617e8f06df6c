"""dsfunc.config: DeepSpeed keys and defaults, batch-triple inference, strict validation, sources."""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import json
import math
import pickle
from pathlib import Path

import pytest
import torch

from dsfunc.config import (
    BF16Config,
    Config,
    ConfigError,
    FP16Config,
    FrozenDict,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from dsfunc.errors import Error
from tests.multiprocess import run_world

RULE = "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"


def load(extra: dict | None = None, world_size: int = 1, **top) -> Config:
    """A config with train_batch_size 8 plus the given keys."""
    return Config.load({"train_batch_size": 8 * world_size, **(extra or {}), **top}, world_size=world_size)


def error(config: dict, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(config, world_size=world_size)
    return str(info.value)


# ----------------------------------------------------------------------------------------------------
# defaults


def test_top_level_defaults():
    c = load()
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 8, 1)
    assert c.world_size == 1
    assert c.optimizer is None and c.scheduler is None
    assert c.gradient_clipping == 1.0
    assert c.steps_per_print is None
    assert c.wall_clock_breakdown is False
    assert c.communication_data_type is None
    assert c.prescale_gradients is False
    assert c.gradient_predivide_factor == 1.0
    assert c.dataloader_drop_last is False
    assert c.zero_allow_untested_optimizer is False
    assert c.grad_accum_dtype is None
    assert (
        c.tensorboard
        == c.csv_monitor
        == MonitorConfig(enabled=False, output_path="", job_name="DeepSpeedJobName")
    )
    assert c.fp16 == FP16Config() and c.bf16 == BF16Config() and c.zero_optimization == ZeroConfig()
    assert c.compute_dtype == torch.float32
    assert c.raw == {"train_batch_size": 8}


def test_fp16_defaults():
    f = load().fp16
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis) == (
        False,
        0.0,
        16,
        1000,
        2,
    )
    assert (f.consecutive_hysteresis, f.min_loss_scale, f.auto_cast, f.raise_error_at_min_scale) == (
        False,
        1.0,
        False,
        True,
    )
    assert load({"fp16": {"enabled": True}}).fp16 == FP16Config(enabled=True)


def test_zero_defaults():
    z = load().zero_optimization
    assert z.stage == 0
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    assert z.overlap_comm is False
    assert (
        z.contiguous_gradients and z.reduce_scatter and z.allgather_partitions and z.ignore_unused_parameters
    )
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_max_live_parameters == z.stage3_max_reuse_distance == z.sub_group_size == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is False and z.round_robin_gradients is False


@pytest.mark.parametrize(
    "stage, given, expected",
    [
        (0, None, False),
        (1, None, False),
        (2, None, False),
        (3, None, True),
        (3, False, False),
        (1, True, True),
    ],
)
def test_overlap_comm_default_depends_on_stage(stage, given, expected):
    zero = {"stage": stage} if given is None else {"stage": stage, "overlap_comm": given}
    assert load({"zero_optimization": zero}).zero_optimization.overlap_comm is expected
    assert ZeroConfig(stage=stage, overlap_comm=given).overlap_comm is expected


ADAM_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "bias_correction": True,
    "adam_w_mode": True,
    "torch_adam": False,
}


@pytest.mark.parametrize(
    "spelling, kind, params, expected",
    [
        ("Adam", "adam", {}, ADAM_DEFAULTS),
        ("adam", "adam", {}, ADAM_DEFAULTS),
        ("AdamW", "adamw", {}, ADAM_DEFAULTS),
        ("ADAMW", "adamw", {}, ADAM_DEFAULTS),
        (
            "SGD",
            "sgd",
            {"lr": 0.1},
            {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
        ),
        (
            "sgd",
            "sgd",
            {"lr": 0.1},
            {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
        ),
        (
            "Lamb",
            "lamb",
            {},
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "bias_correction": True,
                "max_coeff": 10.0,
                "min_coeff": 0.01,
            },
        ),
        (
            "Adagrad",
            "adagrad",
            {},
            {
                "lr": 1e-2,
                "lr_decay": 0.0,
                "weight_decay": 0.0,
                "initial_accumulator_value": 0.0,
                "eps": 1e-10,
            },
        ),
    ],
)
def test_optimizer_defaults_and_spellings(spelling, kind, params, expected):
    opt = load({"optimizer": {"type": spelling, "params": params}}).optimizer
    assert opt == OptimizerConfig(kind, expected)
    assert opt.params == expected and isinstance(opt.params, FrozenDict)


def test_optimizer_params_optional_and_values_normalised():
    assert load({"optimizer": {"type": "Adam"}}).optimizer.params == ADAM_DEFAULTS
    opt = load(
        {"optimizer": {"type": "Adam", "params": {"lr": 1, "betas": [0.8, 0.99], "torch_adam": True}}}
    ).optimizer
    assert opt.params["lr"] == 1.0 and isinstance(opt.params["lr"], float)
    assert opt.params["betas"] == (0.8, 0.99)
    assert opt.params["torch_adam"] is True


def test_adam_w_mode():
    # DeepSpeed's "Adam" is decoupled AdamW unless adam_w_mode is false.
    assert load({"optimizer": {"type": "Adam"}}).optimizer.params["adam_w_mode"] is True
    plain = load({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer
    assert (plain.type, plain.params["adam_w_mode"]) == ("adam", False)
    msg = error({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert 'optimizer.params.adam_w_mode = false contradicts optimizer.type "AdamW"' in msg
    assert '"type": "Adam" with "adam_w_mode": false' in msg


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


@pytest.mark.parametrize(
    "fp16, bf16, dtype",
    [
        (False, False, torch.float32),
        (True, False, torch.float16),
        (False, True, torch.bfloat16),
    ],
)
def test_compute_dtype(fp16, bf16, dtype):
    assert load({"fp16": {"enabled": fp16}, "bf16": {"enabled": bf16}}).compute_dtype == dtype


def test_supported_scalars_are_read():
    c = load(
        {
            "gradient_clipping": 0,
            "steps_per_print": 10,
            "wall_clock_breakdown": True,
            "communication_data_type": "bf16",
            "prescale_gradients": True,
            "gradient_predivide_factor": 2,
            "dataloader_drop_last": True,
            "zero_allow_untested_optimizer": True,
            "data_types": {"grad_accum_dtype": "fp32"},
            "tensorboard": {"enabled": True, "output_path": "runs", "job_name": "exp"},
            "csv_monitor": {"enabled": True},
        }
    )
    assert c.gradient_clipping == 0.0 and c.steps_per_print == 10 and c.wall_clock_breakdown
    assert c.communication_data_type == "bf16" and c.prescale_gradients and c.gradient_predivide_factor == 2.0
    assert c.dataloader_drop_last and c.zero_allow_untested_optimizer and c.grad_accum_dtype == "fp32"
    assert c.tensorboard == MonitorConfig(True, "runs", "exp")
    assert c.csv_monitor == MonitorConfig(True, "", "DeepSpeedJobName")


# ----------------------------------------------------------------------------------------------------
# batch triple

VALUES = {
    "train": ("train_batch_size", lambda w: 6 * w),
    "micro": ("train_micro_batch_size_per_gpu", lambda w: 2),
    "gas": ("gradient_accumulation_steps", lambda w: 3),
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(
    "given, expected",
    [
        (("train", "micro", "gas"), lambda w: (6 * w, 2, 3)),  # only checked
        (("train", "micro"), lambda w: (6 * w, 2, 3)),  # gas = train // micro // world
        (("train", "gas"), lambda w: (6 * w, 2, 3)),  # micro = train // world // gas
        (("micro", "gas"), lambda w: (6 * w, 2, 3)),  # train = micro * gas * world
        (("train",), lambda w: (6 * w, 6, 1)),  # gas = 1, micro = train // world
        (("micro",), lambda w: (2 * w, 2, 1)),  # gas = 1, train = micro * world
    ],
)
def test_batch_triple_inference(world_size, given, expected):
    config = {VALUES[k][0]: VALUES[k][1](world_size) for k in given}
    c = Config.load(config, world_size=world_size)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected(
        world_size
    )
    assert c.world_size == world_size


def test_null_batch_values_count_as_not_given():
    c = Config.load(
        {"train_batch_size": None, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": None},
        world_size=2,
    )
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 1)


@pytest.mark.parametrize("config", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_neither_train_nor_micro(config):
    msg = error(config, world_size=2)
    assert "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided" in msg
    assert "train_batch_size = not set" in msg and "world_size = 2" in msg and RULE in msg


def test_batch_mismatch_message_prints_values_rule_and_fixes():
    msg = error(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        world_size=2,
    )
    assert "32 != 4 * 2 * 2 = 16" in msg
    for line in (
        "train_batch_size = 32",
        "train_micro_batch_size_per_gpu = 4",
        "gradient_accumulation_steps = 2",
        "world_size = 2",
        RULE,
    ):
        assert line in msg
    assert "train_batch_size = 16 (keeping micro batch and accumulation steps)" in msg
    assert "gradient_accumulation_steps = 4 (keeping train batch and micro batch)" in msg
    assert "train_micro_batch_size_per_gpu = 8 (keeping train batch and accumulation steps)" in msg
    for fix in (
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
    ):
        Config.load(fix, world_size=2)


def test_batch_mismatch_only_suggests_divisible_fixes():
    msg = error(
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        world_size=1,
    )
    assert "10 != 4 * 2 * 1 = 8" in msg and "train_batch_size = 8 (keeping" in msg
    assert "gradient_accumulation_steps =" not in msg.split("Values that would work:")[1]
    assert "train_micro_batch_size_per_gpu = 5 (keeping train batch and accumulation steps)" in msg


def test_train_and_micro_not_divisible_is_reported_as_such():
    # DeepSpeed floor-divides to gas = 3 and then fails with "10 != 3 * 3 * 1".
    msg = error({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, world_size=1)
    assert msg.startswith(
        "Cannot derive gradient_accumulation_steps: train_batch_size = 10 is not divisible by "
        "train_micro_batch_size_per_gpu * world_size = 3 * 1 = 3."
    )
    assert "!=" not in msg
    for line in (
        "train_batch_size = 10",
        "train_micro_batch_size_per_gpu = 3",
        "gradient_accumulation_steps = not set",
        "world_size = 1",
        RULE,
    ):
        assert line in msg
    assert "train_batch_size = 9 or 12 (gradient_accumulation_steps 3 or 4)" in msg
    assert (
        "train_micro_batch_size_per_gpu = 1, 2, 5 or 10 (divisors of train_batch_size / world_size = 10)"
        in msg
    )
    for train in (9, 12):
        Config.load({"train_batch_size": train, "train_micro_batch_size_per_gpu": 3}, world_size=1)
    for micro in (1, 2, 5, 10):
        Config.load({"train_batch_size": 10, "train_micro_batch_size_per_gpu": micro}, world_size=1)


def test_train_and_micro_smaller_than_one_step():
    msg = error({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert (
        "train_batch_size = 4 is not divisible by train_micro_batch_size_per_gpu * world_size = 4 * 2 = 8"
        in msg
    )
    assert "train_batch_size = 8 (gradient_accumulation_steps 1)" in msg
    assert "train_micro_batch_size_per_gpu = 1 or 2 (divisors of train_batch_size / world_size = 2)" in msg


def test_train_and_gas_not_divisible():
    msg = error({"train_batch_size": 24, "gradient_accumulation_steps": 5}, world_size=2)
    assert (
        "Cannot derive train_micro_batch_size_per_gpu: train_batch_size = 24 is not divisible by "
        "gradient_accumulation_steps * world_size = 5 * 2 = 10."
    ) in msg
    assert "train_micro_batch_size_per_gpu = not set" in msg and "gradient_accumulation_steps = 5" in msg
    assert "world_size = 2" in msg and RULE in msg
    assert "train_batch_size = 20 or 30 (train_micro_batch_size_per_gpu 2 or 3)" in msg
    assert (
        "gradient_accumulation_steps = 2, 3, 4 or 6 (divisors of train_batch_size / world_size = 12)" in msg
    )


def test_train_only_not_divisible_by_world():
    msg = error({"train_batch_size": 10}, world_size=4)
    assert msg.startswith(
        "Cannot derive train_micro_batch_size_per_gpu: "
        "train_batch_size = 10 is not divisible by world_size = 4."
    )
    assert "train_batch_size = 8 or 12 (train_micro_batch_size_per_gpu 2 or 3)" in msg
    assert "train_micro_batch_size_per_gpu = not set" in msg and RULE in msg


@pytest.mark.parametrize(
    "key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
)
@pytest.mark.parametrize("value", [0, -4, True, 2.0, "8"])
def test_batch_values_must_be_positive_ints(key, value):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    msg = error({**config, key: value})
    assert msg == f"{key} = {json.dumps(value)} is invalid: expected a positive integer."


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_world_size_must_be_positive_int(world_size):
    with pytest.raises(ConfigError, match="world_size = .* is invalid: expected a positive integer"):
        Config.load({"train_batch_size": 8}, world_size=world_size)


def _load_in_process_group(rank: int, world_size: int) -> tuple[int, int]:
    c = Config.load({"train_micro_batch_size_per_gpu": 3})
    return c.world_size, c.train_batch_size


def test_world_size_defaults_to_process_group():
    assert run_world(_load_in_process_group, 2) == [(2, 6), (2, 6)]


def test_direct_construction_checks_the_triple():
    with pytest.raises(ConfigError, match=r"8 != 4 \* 1 \* 1 = 4"):
        Config(8, 4, 1, 1, None, None, FP16Config(), BF16Config(), ZeroConfig())
    c = load()
    with pytest.raises(ConfigError, match=r"8 != 8 \* 1 \* 2 = 16"):
        dataclasses.replace(c, world_size=2)


# ----------------------------------------------------------------------------------------------------
# unknown keys


def test_config_error_is_a_dsfunc_error_and_a_value_error():
    for base in (Error, ValueError):
        with pytest.raises(base, match='Unknown config key "gradient_cliping"'):
            Config.load({"train_batch_size": 8, "gradient_cliping": 1.0})


@pytest.mark.parametrize(
    "config, key, suggestion",
    [
        ({"train_batch_szie": 8}, "train_batch_szie", "train_batch_size"),
        ({"wall_clock_breakdwn": True}, "wall_clock_breakdwn", "wall_clock_breakdown"),
        ({"gradient_cliping": 1.0}, "gradient_cliping", "gradient_clipping"),
        ({"fp16": {"loss_scael": 0}}, "fp16.loss_scael", "fp16.loss_scale"),
        ({"fp16": {"intial_scale_power": 8}}, "fp16.intial_scale_power", "fp16.initial_scale_power"),
        ({"bf16": {"enable": True}}, "bf16.enable", "bf16.enabled"),
        ({"zero_optimization": {"stag": 2}}, "zero_optimization.stag", "zero_optimization.stage"),
        (
            {"zero_optimization": {"overlap_com": True}},
            "zero_optimization.overlap_com",
            "zero_optimization.overlap_comm",
        ),
        (
            {"zero_optimization": {"zero_quantized_weigths": False}},
            "zero_optimization.zero_quantized_weigths",
            "zero_optimization.zero_quantized_weights",
        ),
        ({"optimizer": {"typ": "Adam"}}, "optimizer.typ", "optimizer.type"),
        (
            {"optimizer": {"type": "Adam", "params": {"weight_decy": 0.1}}},
            "optimizer.params.weight_decy",
            "optimizer.params.weight_decay",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}},
            "optimizer.params.momentun",
            "optimizer.params.momentum",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
            "scheduler.params.warmup_num_step",
            "scheduler.params.warmup_num_steps",
        ),
        ({"tensorboard": {"output_dir": "x"}}, "tensorboard.output_dir", "tensorboard.output_path"),
        (
            {"data_types": {"grad_acum_dtype": "fp32"}},
            "data_types.grad_acum_dtype",
            "data_types.grad_accum_dtype",
        ),
        ({"checkpoint": {"tag_validaton": "Warn"}}, "checkpoint.tag_validaton", "checkpoint.tag_validation"),
    ],
)
def test_misspelled_key_names_path_and_suggestion(config, key, suggestion):
    msg = error({"train_batch_size": 8, **config})
    assert msg.startswith(f'Unknown config key "{key}". Did you mean "{suggestion}"?')


def test_unknown_key_without_close_match_lists_valid_keys():
    msg = error({"train_batch_size": 8, "fp16": {"xyz": 1}})
    assert msg.startswith('Unknown config key "fp16.xyz". Valid keys in "fp16": enabled, loss_scale,')
    msg = error({"train_batch_size": 8, "qqq": 1})
    assert 'Unknown config key "qqq". Valid keys in the top level: train_batch_size,' in msg
    assert "rejects unknown keys" in msg


def test_params_for_another_optimizer_are_unknown():
    msg = error({"train_batch_size": 8, "optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})
    assert 'Unknown config key "optimizer.params.betas"' in msg


def test_max_grad_norm_points_to_gradient_clipping():
    msg = error({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert msg.startswith(
        "optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer "
        "parameter, please switch to using the deepspeed parameter 'gradient_clipping'"
    )


# ----------------------------------------------------------------------------------------------------
# bad values


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale = -1 is invalid: expected a finite number >= 0."),
        (
            {"fp16": {"loss_scale": math.inf}},
            "fp16.loss_scale = Infinity is invalid: expected a finite number >= 0.",
        ),
        (
            {"fp16": {"loss_scale": math.nan}},
            "fp16.loss_scale = NaN is invalid: expected a finite number >= 0.",
        ),
        ({"fp16": {"loss_scale": True}}, "fp16.loss_scale = true is invalid: expected a finite number >= 0."),
        (
            {"fp16": {"loss_scale": "128"}},
            'fp16.loss_scale = "128" is invalid: expected a finite number >= 0.',
        ),
        (
            {"fp16": {"loss_scale_window": 0}},
            "fp16.loss_scale_window = 0 is invalid: expected an integer >= 1.",
        ),
        (
            {"fp16": {"min_loss_scale": 0}},
            "fp16.min_loss_scale = 0 is invalid: expected a finite number > 0.",
        ),
        ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis = 0 is invalid: expected an integer >= 1."),
        (
            {"fp16": {"initial_scale_power": -1}},
            "fp16.initial_scale_power = -1 is invalid: expected an integer >= 0 and <= 127.",
        ),
        ({"fp16": {"enabled": 1}}, "fp16.enabled = 1 is invalid: expected true or false."),
        ({"fp16": True}, "fp16 = true is invalid: expected a JSON object."),
        (
            {"zero_optimization": {"stage": 4}},
            "zero_optimization.stage = 4 is invalid: expected an integer >= 0 and <= 3.",
        ),
        (
            {"zero_optimization": {"stage": "2"}},
            'zero_optimization.stage = "2" is invalid: expected an integer >= 0 and <= 3.',
        ),
        (
            {"zero_optimization": {"stage": 2.0}},
            "zero_optimization.stage = 2.0 is invalid: expected an integer >= 0 and <= 3.",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 1.5}},
            (
                "zero_optimization.reduce_bucket_size = 1.5 is invalid: expected an integer >= 0 "
                "(5e8-style numbers are fine)."
            ),
        ),
        (
            {"zero_optimization": {"allgather_bucket_size": -1}},
            "zero_optimization.allgather_bucket_size = -1 is invalid: expected an integer >= 0",
        ),
        ({"zero_optimization": {"overlap_comm": "yes"}}, 'zero_optimization.overlap_comm = "yes" is invalid'),
        ({"zero_optimization": 1}, "zero_optimization = 1 is invalid: expected a JSON object."),
        ({"gradient_clipping": -0.5}, "gradient_clipping = -0.5 is invalid: expected a finite number >= 0."),
        ({"steps_per_print": 0}, "steps_per_print = 0 is invalid: expected an integer >= 1."),
        (
            {"communication_data_type": "fp8"},
            'communication_data_type = "fp8" is invalid: expected one of "fp32", "fp16", "bf16".',
        ),
        (
            {"gradient_predivide_factor": 0},
            "gradient_predivide_factor = 0 is invalid: expected a finite number > 0.",
        ),
        (
            {"wall_clock_breakdown": "false"},
            'wall_clock_breakdown = "false" is invalid: expected true or false.',
        ),
        ({"tensorboard": {"output_path": 3}}, "tensorboard.output_path = 3 is invalid: expected a string."),
        (
            {"data_types": {"grad_accum_dtype": "float32"}},
            'data_types.grad_accum_dtype = "float32" is invalid',
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
            (
                "optimizer.params.betas = [0.9, 1.0] is invalid: "
                "expected a list of two numbers, each >= 0 and < 1."
            ),
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
            "optimizer.params.betas = [0.9] is invalid",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [-0.1, 0.9]}}},
            "optimizer.params.betas = [-0.1, 0.9]",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": -1e-3}}},
            "optimizer.params.lr = -0.001 is invalid: expected a finite number >= 0.",
        ),
        ({"optimizer": {"type": "Lamb", "params": {"eps": -1}}}, "optimizer.params.eps = -1 is invalid"),
        (
            {"optimizer": {"type": "Adam", "params": {"bias_correction": 0}}},
            "optimizer.params.bias_correction = 0 is invalid: expected true or false.",
        ),
        (
            {"optimizer": {"type": 3}},
            "optimizer.type = 3 is invalid: expected one of Adam, AdamW, SGD, Lamb, Adagrad.",
        ),
        ({"optimizer": {"params": {}}}, "optimizer.type is required."),
        (
            {"optimizer": {"type": "Adam", "params": [1]}},
            "optimizer.params = [1] is invalid: expected a JSON object.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
            "scheduler.params.warmup_num_steps = 0 is invalid: expected an integer >= 1.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10.5}}},
            "scheduler.params.warmup_num_steps = 10.5 is invalid: expected an integer >= 1.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
            'scheduler.params.warmup_type = "cosine" is invalid: expected one of "log", "linear".',
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}},
            "scheduler.params.warmup_max_lr = [0.1, 0.2] is invalid: expected a finite number >= 0.",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {}}},
            'scheduler.params.total_num_steps is required for scheduler "WarmupDecayLR".',
        ),
        (
            {"scheduler": {"type": "WarmupCosineLR"}},
            'scheduler.params.total_num_steps is required for scheduler "WarmupCosineLR".',
        ),
        (
            {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}},
            'scheduler.params.cycle_max_lr is required for scheduler "OneCycle".',
        ),
        (
            {"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}},
            'scheduler.params.cycle_min_lr is required for scheduler "OneCycle".',
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}},
            "scheduler.params.total_num_steps = 500 is smaller than warmup_num_steps = 1000",
        ),
        (
            {"scheduler": {"type": "LRRangeTest", "params": {"last_batch_iteration": -2}}},
            "scheduler.params.last_batch_iteration = -2 is invalid: expected an integer >= -1.",
        ),
    ],
)
def test_bad_values_name_path_value_and_allowed(config, expected):
    assert expected in error({"train_batch_size": 8, **config})


@pytest.mark.parametrize(
    "optimizer, expected",
    [
        ({"type": "SGD"}, 'optimizer.params.lr is required for optimizer type "SGD".'),
        (
            {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}},
            (
                "optimizer.params.nesterov = true requires momentum > 0 and dampening = 0 "
                "(as torch.optim.SGD), got momentum = 0 and dampening = 0."
            ),
        ),
        (
            {"type": "SGD", "params": {"lr": 0.1, "nesterov": True, "momentum": 0.9, "dampening": 0.1}},
            "got momentum = 0.9 and dampening = 0.1",
        ),
        (
            {"type": "Lamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}},
            "optimizer.params.min_coeff = 2 is larger than max_coeff = 1",
        ),
    ],
)
def test_optimizer_cross_param_rules(optimizer, expected):
    assert expected in error({"train_batch_size": 8, "optimizer": optimizer})


def test_sgd_nesterov_accepted_with_momentum():
    p = load(
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}}
    ).optimizer.params
    assert p["nesterov"] and p["momentum"] == 0.9


@pytest.mark.parametrize(
    "kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion", "Muon", "RMSprop", "Adamax"]
)
def test_unsupported_optimizer_lists_supported(kind):
    msg = error({"train_batch_size": 8, "optimizer": {"type": kind}})
    assert msg.startswith(
        f'optimizer.type = "{kind}": this optimizer is not supported by dsfunc '
        "(supported: Adam, AdamW, SGD, Lamb, Adagrad)."
    )


def test_misspelled_optimizer_and_scheduler_type_suggest():
    assert 'Did you mean "AdamW"?' in error({"train_batch_size": 8, "optimizer": {"type": "AdamWW"}})
    msg = error({"train_batch_size": 8, "scheduler": {"type": "WarmupDecay"}})
    assert msg.startswith(
        'scheduler.type = "WarmupDecay": this LR scheduler is not supported by dsfunc (supported: '
        "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)."
    )
    assert 'Did you mean "WarmupDecayLR"?' in msg
    assert "not supported by dsfunc" in error({"train_batch_size": 8, "scheduler": {"type": "StepLR"}})


def test_both_precisions_enabled():
    msg = error({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "bfloat16 and fp16 modes cannot be simultaneously enabled" in msg
    load({"fp16": {"enabled": True}, "bf16": {"enabled": False}})


def test_loss_scaling_keys_in_bf16_are_explained():
    msg = error({"train_batch_size": 8, "bf16": {"enabled": True, "loss_scale_window": 500}})
    assert msg == (
        "bf16.loss_scale_window: loss scaling only applies to fp16; bf16 has the range of fp32 and needs no "
        "loss scale. Remove this key from the bf16 section."
    )


@pytest.mark.parametrize(
    "config, path",
    [
        ({"train_batch_size": "auto"}, "train_batch_size"),
        ({"train_batch_size": 8, "gradient_clipping": "auto"}, "gradient_clipping"),
        ({"train_batch_size": 8, "fp16": {"enabled": "auto"}}, "fp16.enabled"),
        (
            {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
            "optimizer.params.lr",
        ),
        (
            {
                "train_batch_size": 8,
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
            },
            "scheduler.params.total_num_steps",
        ),
        (
            {"train_batch_size": 8, "zero_optimization": {"stage3_prefetch_bucket_size": "auto"}},
            "zero_optimization.stage3_prefetch_bucket_size",
        ),
        (
            {"train_batch_size": 8, "zero_optimization": {"zero_hpz_partition_size": "auto"}},
            "zero_optimization.zero_hpz_partition_size",
        ),
        ({"train_batch_size": 8, "wandb": {"enabled": "auto"}}, "wandb.enabled"),
    ],
)
def test_auto_values_explained(config, path):
    msg = error(config)
    assert msg.startswith(f'{path} = "auto": "auto" is a placeholder that the Hugging Face Trainer replaces')
    assert "dsfunc reads the config itself, so write the actual value here" in msg


# ----------------------------------------------------------------------------------------------------
# legacy forms and aliases


def test_legacy_zero_bool():
    assert load({"zero_optimization": True}).zero_optimization == ZeroConfig(stage=1)
    assert load({"zero_optimization": False}).zero_optimization == ZeroConfig(stage=0)


def test_bfloat16_old_name():
    c = load({"bfloat16": {"enabled": True}})
    assert c.bf16.enabled and c.compute_dtype == torch.bfloat16
    msg = error({"train_batch_size": 8, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert msg == '"bf16" and "bfloat16" are two spellings of the same key (bf16); keep one.'


@pytest.mark.parametrize(
    "alias, key",
    [
        ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
        ("param_persistence_threshold", "stage3_param_persistence_threshold"),
        ("max_live_parameters", "stage3_max_live_parameters"),
        ("max_reuse_distance", "stage3_max_reuse_distance"),
    ],
)
def test_zero_short_names(alias, key):
    assert getattr(load({"zero_optimization": {alias: 1234}}).zero_optimization, key) == 1234
    msg = error({"train_batch_size": 8, "zero_optimization": {alias: 1, key: 2}})
    assert f'"zero_optimization.{alias}" and "zero_optimization.{key}" are two spellings' in msg


@pytest.mark.parametrize(
    "name",
    [
        "stage3_gather_fp16_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
    ],
)
def test_gather_16bit_weights_spellings(name):
    assert load(
        {"zero_optimization": {"stage": 3, name: True}}
    ).zero_optimization.stage3_gather_16bit_weights_on_model_save


def test_sizes_accept_5e8_style_floats():
    z = load(
        {
            "zero_optimization": {
                "reduce_bucket_size": 2e8,
                "allgather_bucket_size": 5e8,
                "sub_group_size": 1e9,
                "stage3_prefetch_bucket_size": 4.5e8,
            }
        }
    ).zero_optimization
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.sub_group_size) == (
        200_000_000,
        500_000_000,
        10**9,
    )
    assert z.stage3_prefetch_bucket_size == 450_000_000 and isinstance(z.reduce_bucket_size, int)


@pytest.mark.parametrize(
    "zero",
    [
        {"cpu_offload": False},
        {"cpu_offload_param": False},
        {"cpu_offload_use_pin_memory": True},
        {"offload_optimizer": {"device": "none", "pin_memory": True}},
        {"offload_param": {"device": "none"}},
        {"offload_optimizer": None},
        {"zero_quantized_weights": False},
        {"zero_hpz_partition_size": 1},
        {"mics_shard_size": -1},
        {"memory_efficient_linear": True},
        {"stage3_model_persistence_threshold": 2**63 - 1},
        {"elastic_checkpoint": False},
        {"leaf_module": {}},
        {"zeropp_loco_param": None},
    ],
)
def test_zero_keys_at_default_are_accepted(zero):
    assert load({"zero_optimization": {"stage": 3, **zero}}).zero_optimization == ZeroConfig(stage=3)


@pytest.mark.parametrize(
    "zero, expected",
    [
        (
            {"offload_optimizer": {"device": "cpu"}},
            (
                'zero_optimization.offload_optimizer.device = "cpu": offloading optimizer state to CPU/NVMe '
                "(ZeRO-Offload / ZeRO-Infinity) is not supported by dsfunc."
            ),
        ),
        (
            {"offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
            'zero_optimization.offload_param.device = "nvme": offloading parameters to CPU/NVMe',
        ),
        ({"offload_optimizer": {"pin_memory": True, "device": "cpu"}}, 'set its device to "none"'),
        ({"cpu_offload": True}, "zero_optimization.cpu_offload = true: dsfunc does not support ZeRO-Offload"),
        (
            {"zero_quantized_weights": True},
            (
                "zero_optimization.zero_quantized_weights = true: dsfunc does not support ZeRO++ quantized "
                "weights yet. Remove the key or set it to false (DeepSpeed's default)."
            ),
        ),
        ({"zero_quantized_gradients": True}, "ZeRO++ quantized gradients"),
        (
            {"zero_hpz_partition_size": 8},
            "zero_optimization.zero_hpz_partition_size = 8: dsfunc does not support ZeRO++",
        ),
        ({"zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}, "ZeRO++ LoCo"),
        (
            {"mics_shard_size": 8},
            "zero_optimization.mics_shard_size = 8: dsfunc does not support MiCS sharding yet",
        ),
        ({"legacy_stage1": True}, "legacy ZeRO stage 1"),
        ({"leaf_module": {"classes": ["MoE"]}}, "dsfunc does not support ZeRO-3 leaf modules yet"),
        (
            {"model_persistence_threshold": 10},
            "zero_optimization.model_persistence_threshold = 10: dsfunc does not support",
        ),
    ],
)
def test_zero_features_dsfunc_lacks(zero, expected):
    assert expected in error({"train_batch_size": 8, "zero_optimization": {"stage": 3, **zero}})


# ----------------------------------------------------------------------------------------------------
# known DeepSpeed sections dsfunc does not implement


@pytest.mark.parametrize(
    "section",
    [
        {"amp": {"enabled": False, "opt_level": "O1"}},
        {
            "flops_profiler": {
                "enabled": False,
                "profile_step": 1,
                "module_depth": -1,
                "top_modules": 1,
                "detailed": True,
            }
        },
        {
            "activation_checkpointing": {
                "partition_activations": False,
                "cpu_checkpointing": False,
                "contiguous_memory_optimization": False,
                "number_checkpoints": None,
                "synchronize_checkpoint_boundary": False,
                "profile": False,
            }
        },
        {"autotuning": {"enabled": False, "fast": True}},
        {"elasticity": {"enabled": False, "max_train_batch_size": 100}},
        {"pipeline": {"stages": "auto", "partition": "best", "pipe_partitioned": True}},
        {"sparse_attention": {}},
        {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}}},
        {"wandb": {"enabled": False, "project": "x", "team": None}},
        {"comet": {"enabled": False}},
        {"comms_logger": {"enabled": False, "verbose": True}},
        {"aio": {"block_size": 1048576, "queue_depth": 16}},
        {
            "checkpoint": {
                "tag_validation": "warn",
                "load_universal": False,
                "parallel_write": {"pipeline_stage": False},
            }
        },
        {"data_efficiency": {"enabled": False, "data_sampling": {"enabled": False}}},
        {"timers": {"throughput": {"enabled": True, "synchronized": True}}},
        {"memory_breakdown": False},
        {"dump_state": False},
        {"log_level": None},
        {"vocabulary_size": 50257},
        {"sparse_gradients": False},
        {"zero_force_ds_cpu_optimizer": False},
        {"disable_allgather": False},
        {"gradient_allreduce_op": "mean"},
        {"torch_autocast": {"enabled": False, "dtype": "bfloat16"}},
        {"hybrid_engine": {"enabled": False}},
        {"compile": {"enabled": False}},
        {"tensor_parallel": {}},
        {"sequence_parallel_size": 1},
        {"managed_gradient_accumulation": True},
    ],
)
def test_unimplemented_sections_accepted_when_off(section):
    assert load(section).raw == {"train_batch_size": 8, **section}


@pytest.mark.parametrize(
    "section, expected",
    [
        (
            {"amp": {"enabled": True}},
            (
                "amp.enabled = true: dsfunc does not support Apex AMP yet. Set it to false or remove "
                '"amp". Use "fp16" or "bf16" instead.'
            ),
        ),
        (
            {"flops_profiler": {"enabled": True}},
            "flops_profiler.enabled = true: dsfunc does not support the FLOPs profiler",
        ),
        (
            {"activation_checkpointing": {"partition_activations": True}},
            (
                "activation_checkpointing.partition_activations = true: dsfunc does not support DeepSpeed's "
                "activation checkpointing yet. Remove the key or set it to false (DeepSpeed's default). "
                "Use torch.utils.checkpoint inside the model."
            ),
        ),
        (
            {"activation_checkpointing": {"number_checkpoints": 4}},
            "activation_checkpointing.number_checkpoints = 4",
        ),
        ({"autotuning": {"enabled": True}}, "dsfunc does not support autotuning yet"),
        ({"elasticity": {"enabled": True}}, "dsfunc does not support elastic batch sizes yet"),
        (
            {"pipeline": {"stages": 2}},
            (
                "pipeline.stages = 2: dsfunc does not support pipeline parallelism yet. Remove the "
                'key or set it to "auto"'
            ),
        ),
        ({"sparse_attention": {"mode": "fixed"}}, "dsfunc does not support sparse attention yet"),
        (
            {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
            (
                "compression_training.weight_quantization.shared_parameters.enabled = true: "
                "dsfunc does not support compression training yet"
            ),
        ),
        (
            {"wandb": {"enabled": True, "project": "x"}},
            (
                "wandb.enabled = true: dsfunc does not support the Weights & Biases monitor yet. "
                'Set it to false or remove "wandb". dsfunc has "tensorboard" and "csv_monitor".'
            ),
        ),
        ({"wandb": {"enabled": "yes"}}, 'wandb.enabled = "yes" is invalid: expected true or false.'),
        ({"wandb": True}, "wandb = true is invalid: expected a JSON object."),
        ({"comet": {"enabled": True}}, "the Comet monitor"),
        ({"comms_logger": {"enabled": True}}, "the communication logger"),
        (
            {"checkpoint": {"load_universal": True}},
            "checkpoint.load_universal = true: dsfunc does not support these checkpoint options yet",
        ),
        ({"checkpoint": {"tag_validation": "Fail"}}, 'checkpoint.tag_validation = "Fail"'),
        (
            {"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
            "checkpoint.parallel_write.pipeline_stage = true",
        ),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency.enabled = true"),
        (
            {"timers": {"throughput": {"enabled": False}}},
            "timers.throughput.enabled = false: dsfunc does not support",
        ),
        (
            {"memory_breakdown": True},
            "memory_breakdown = true: dsfunc does not support memory breakdown logging yet",
        ),
        ({"dump_state": True}, "dump_state = true"),
        ({"log_level": "info"}, 'log_level = "info": dsfunc does not support log_level yet'),
        ({"sparse_gradients": True}, "sparse embedding gradients"),
        ({"disable_allgather": True}, "disable_allgather = true"),
        (
            {"gradient_allreduce_op": "sum"},
            'gradient_allreduce_op = "sum": dsfunc does not support summed gradient',
        ),
        ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled = true"),
        ({"hybrid_engine": {"enabled": True}}, "the hybrid (RLHF) engine"),
        ({"tensor_parallel": {"autotp_size": 2}}, "dsfunc does not support tensor parallelism yet"),
        (
            {"sequence_parallel_size": 2},
            "sequence_parallel_size = 2: dsfunc does not support sequence parallelism",
        ),
        ({"managed_gradient_accumulation": False}, "unmanaged gradient accumulation"),
        ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads = true"),
        ({"bf16": {"immediate_grad_update": True}}, "bf16.immediate_grad_update = true"),
        ({"bf16": {"check_grad_overflow": False}}, "bf16.check_grad_overflow = false"),
        ({"data_types": {"param_dtype": "bf16"}}, 'data_types.param_dtype = "bf16": dsfunc does not support'),
        ({"optimizer": {"type": "Adam", "legacy_fusion": True}}, "optimizer.legacy_fusion = true"),
    ],
)
def test_unimplemented_sections_rejected_when_on(section, expected):
    assert expected in error({"train_batch_size": 8, **section})


def test_unknown_key_inside_default_only_section():
    msg = error({"train_batch_size": 8, "activation_checkpointing": {"partition_activation": False}})
    assert msg.startswith(
        'Unknown config key "activation_checkpointing.partition_activation". Did you mean '
        '"activation_checkpointing.partition_activations"?'
    )


# ----------------------------------------------------------------------------------------------------
# sources


def test_json_file_str_and_pathlike(tmp_path: Path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}))
    for source in (path, str(path)):
        c = Config.load(source, world_size=2)
        assert c.train_batch_size == 8 and c.fp16.enabled
        assert c.raw == {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{\n  "train_batch_size": 8, // per step\n}', "invalid JSON at line 2, column 26"),
        ('{\n  "train_batch_size": 8, // per step\n}', "It looks like a comment: dsfunc reads strict JSON"),
        ('{\n  # comment\n  "train_batch_size": 8\n}', "line 2, column 3"),
        ('{\n  "train_batch_size": 8,\n}', "line 3, column 1"),
        (
            '{\n  "train_batch_size": 8,\n}',
            "It looks like a trailing comma: dsfunc reads strict JSON, remove it.",
        ),
        ('{"fp16": {"enabled": true, "loss_scale": 0,\n  }}', "trailing comma"),
        (
            '{"train_batch_size": 8, "train_batch_size": 16}',
            'Duplicate key "train_batch_size" in the config; keep one.',
        ),
        ("[1, 2]", "the config must be a JSON object, got list"),
    ],
)
def test_bad_json_files(tmp_path: Path, text, expected):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    assert expected in str(info.value) and str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="DeepSpeed config file 'no/such/ds_config.json' does not exist"):
        Config.load("no/such/ds_config.json")
    with pytest.raises(ConfigError, match="Cannot read the DeepSpeed config file 'no/such.json'"):
        Config.load(Path("no/such.json"))


def test_base64_string():
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 12}).encode()).decode()
    assert Config.load(encoded, world_size=3).train_micro_batch_size_per_gpu == 4


def test_argparse_namespace(tmp_path: Path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 16, "gradient_accumulation_steps": 2}')
    args = argparse.Namespace(deepspeed=True, deepspeed_config=str(path), local_rank=0)
    assert Config.load(args, world_size=2).train_micro_batch_size_per_gpu == 4
    assert Config.load(argparse.Namespace(deepspeed_config={"train_batch_size": 4})).train_batch_size == 4
    with pytest.raises(
        ConfigError, match="args.deepspeed_config is not set: pass --deepspeed_config ds_config.json"
    ):
        Config.load(argparse.Namespace(deepspeed=True))
    with pytest.raises(ConfigError, match="args.deepspeed_config is not set"):
        Config.load(argparse.Namespace(deepspeed_config=None))


def test_unsupported_source_type():
    with pytest.raises(ConfigError, match="Cannot read a DeepSpeed config from a int"):
        Config.load(42)


def test_config_source_is_reresolved_for_another_world_size():
    c = Config.load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert c.gradient_accumulation_steps == 4
    assert Config.load(c, world_size=2) is c
    c4 = Config.load(c, world_size=4)
    assert (
        c4.world_size,
        c4.train_batch_size,
        c4.train_micro_batch_size_per_gpu,
        c4.gradient_accumulation_steps,
    ) == (4, 32, 4, 2)
    assert c4.raw == c.raw
    per_rank = Config.load(
        {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=2
    )
    assert Config.load(per_rank, world_size=4).train_batch_size == 32
    assert "not divisible by train_micro_batch_size_per_gpu * world_size = 4 * 16 = 64" in error(
        c.raw, world_size=16
    )


def test_dict_source_is_not_mutated_and_later_changes_do_not_leak():
    raw = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}}}
    before = copy.deepcopy(raw)
    c = Config.load(raw)
    assert raw == before
    raw["optimizer"]["params"]["betas"][0] = 0.5
    assert c.raw["optimizer"]["params"]["betas"] == (0.9, 0.99)


# ----------------------------------------------------------------------------------------------------
# immutability, hashing, serialisation


def full_config() -> Config:
    return load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 2000, "warmup_num_steps": 100},
            },
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2},
            "steps_per_print": 50,
            "tensorboard": {"enabled": True, "output_path": "tb"},
        },
        world_size=2,
    )


def test_config_is_frozen_and_hashable():
    c = full_config()
    assert hash(c) == hash(full_config()) and c == full_config() and len({c, full_config()}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train_batch_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.zero_optimization.stage = 3
    for mutate in (
        lambda: c.optimizer.params.__setitem__("lr", 1.0),
        lambda: c.optimizer.params.update(lr=1.0),
        lambda: c.raw.pop("bf16"),
        lambda: c.raw["optimizer"].clear(),
        lambda: c.scheduler.params.setdefault("x", 1),
    ):
        with pytest.raises(TypeError, match="FrozenDict is immutable"):
            mutate()
    with pytest.raises(TypeError, match="FrozenDict is immutable"):
        params = c.optimizer.params
        params |= {"lr": 1.0}
    assert c.optimizer.params["lr"] == 3e-4


def test_pickle_and_deepcopy_round_trip():
    c = full_config()
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.deepcopy(c) == c
    assert isinstance(pickle.loads(pickle.dumps(c)).raw, FrozenDict)


def test_to_dict_is_json_and_loads_back_to_the_same_values():
    c = full_config()
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["optimizer"] == {
        "type": "adamw",
        "params": {
            "lr": 3e-4,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.0,
            "bias_correction": True,
            "adam_w_mode": True,
            "torch_adam": False,
        },
    }
    assert d["zero_optimization"]["overlap_comm"] is False and d["bf16"] == {"enabled": True}
    assert d["data_types"] == {"grad_accum_dtype": None}
    again = Config.load(d, world_size=c.world_size)
    assert again.to_dict() == d
    assert dataclasses.replace(again, raw={}) == dataclasses.replace(c, raw={})
    assert json.loads(json.dumps(dict(c.raw)))["optimizer"]["params"]["betas"] == [0.9, 0.95]


def test_every_dataclass_field_is_a_config_key():
    for cls, section in (
        (FP16Config, "fp16"),
        (BF16Config, "bf16"),
        (ZeroConfig, "zero_optimization"),
        (MonitorConfig, "tensorboard"),
    ):
        for f in dataclasses.fields(cls):
            value = getattr(cls(), f.name)
            assert getattr(load({section: {f.name: value}}), section) == cls()


# ----------------------------------------------------------------------------------------------------
# realistic configs

CIFAR10_TUTORIAL = {
    "train_batch_size": 16,
    "steps_per_print": 2000,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
    },
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "fp16": {
        "enabled": True,
        "fp16_master_weights_and_grads": False,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 15,
    },
    "bf16": {"enabled": False},
    "wall_clock_breakdown": False,
    "zero_optimization": {
        "stage": 0,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 50000000,
        "reduce_bucket_size": 50000000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "cpu_offload": False,
    },
}

ZERO3_BF16 = {
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 2e-5,
            "warmup_num_steps": 100,
            "total_num_steps": 10000,
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1e7,
        "stage3_prefetch_bucket_size": 9e6,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "train_micro_batch_size_per_gpu": 2,
    "wall_clock_breakdown": False,
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False},
    "flops_profiler": {
        "enabled": False,
        "profile_step": 1,
        "module_depth": -1,
        "top_modules": 1,
        "detailed": True,
        "output_file": None,
    },
    "wandb": {"enabled": False},
}


def test_cifar10_tutorial_config_loads():
    c = Config.load(CIFAR10_TUTORIAL, world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 8, 1)
    assert c.optimizer == OptimizerConfig(
        "adam", {**ADAM_DEFAULTS, "betas": (0.8, 0.999), "weight_decay": 3e-7}
    )
    assert c.scheduler.params["warmup_max_lr"] == 0.001 and c.scheduler.params["warmup_type"] == "log"
    assert c.fp16 == FP16Config(enabled=True, loss_scale_window=500, initial_scale_power=15)
    assert c.zero_optimization.overlap_comm and c.zero_optimization.reduce_bucket_size == 50_000_000
    assert c.compute_dtype == torch.float16 and c.steps_per_print == 2000


def test_zero3_bf16_config_loads(tmp_path: Path):
    path = tmp_path / "ds_zero3.json"
    path.write_text(json.dumps(ZERO3_BF16, indent=2))
    c = Config.load(path, world_size=4)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (32, 2, 4)
    z = c.zero_optimization
    assert z.stage == 3 and z.overlap_comm and z.stage3_gather_16bit_weights_on_model_save
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.sub_group_size) == (
        10**7,
        9 * 10**6,
        10**9,
    )
    assert c.optimizer.type == "adamw" and c.optimizer.params["weight_decay"] == 0.1
    assert c.scheduler == SchedulerConfig(
        "WarmupDecayLR",
        {
            "total_num_steps": 10000,
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 2e-5,
            "warmup_num_steps": 100,
            "warmup_type": "log",
            "last_batch_iteration": -1,
        },
    )
    assert c.compute_dtype == torch.bfloat16 and c.gradient_clipping == 1.0
