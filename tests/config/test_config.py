"""Config as a whole: top-level keys and defaults, immutability, hashing, serialisation, realistic configs."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

from dsfunc.config import (
    BF16Config,
    Config,
    FP16Config,
    FrozenDict,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from tests.config.helpers import ADAM_DEFAULTS, load


def test_top_level_defaults():
    c = load()
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 8, 1)
    assert c.world_size == 1
    assert c.optimizer is None and c.scheduler is None
    assert c.gradient_clipping == 1.0
    assert c.steps_per_print == 10  # dsfunc's default (DeepSpeed 0.19.8's is None)
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
    assert d["zero_optimization"]["overlap_comm"] is False
    assert d["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False,
                         "rounding": "nearest"}
    assert d["data_types"] == {"grad_accum_dtype": None, "buffer_dtype": None}
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
            if dataclasses.is_dataclass(value):  # a section of its own: written as its JSON object
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(value).items()}
            assert getattr(load({section: {f.name: value}}), section) == cls()


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
