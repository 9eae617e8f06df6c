"""What every section shares: ConfigError, unknown and misspelled keys, bad values, type names, "auto"."""

from __future__ import annotations

import math

import pytest

from dsfunc.config import Config
from dsfunc.errors import Error
from tests.config.helpers import error


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
            {"fp16": {"enabled": True, "loss_scale_window": 0}},
            "fp16.loss_scale_window = 0 is invalid: expected an integer >= 1.",
        ),
        (
            {"fp16": {"enabled": True, "min_loss_scale": 0.0}},
            "fp16.min_loss_scale = 0.0 is invalid: expected a finite number > 0.",
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
            "optimizer.type = 3 is invalid: expected one of Adam, AdamW, SGD, Lamb, Adagrad, Muon.",
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


def test_misspelled_optimizer_and_scheduler_type_suggest():
    assert 'Did you mean "AdamW"?' in error({"train_batch_size": 8, "optimizer": {"type": "AdamWW"}})
    msg = error({"train_batch_size": 8, "scheduler": {"type": "WarmupDecay"}})
    assert msg.startswith(
        'scheduler.type = "WarmupDecay": this LR scheduler is not supported by dsfunc (supported: '
        "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)."
    )
    assert 'Did you mean "WarmupDecayLR"?' in msg
    assert "not supported by dsfunc" in error({"train_batch_size": 8, "scheduler": {"type": "StepLR"}})


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
