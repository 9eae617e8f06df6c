"""DeepSpeed's config classes (``DeepSpeedConfig``, ``DeepSpeedZeroConfig``, the offload configs) answer as
real DeepSpeed 0.19.8's do for the same config, read by dsfunc's one parser."""

from __future__ import annotations

from pathlib import Path

import pytest

import dsfunc
from dsfunc.deepspeed.config import DeepSpeedConfig
from dsfunc.deepspeed.precision_config import get_bfloat16_config, get_float16_config
from dsfunc.deepspeed.zero_config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    ZeroStageEnum,
)

CONFIGS = [
    {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
    {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "bf16": {"enabled": True},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 123, "cpu_offload": True,
                           "offload_param": {"device": "cpu"}},
     "checkpoint": {"tag_validation": "fail"}, "zero_allow_untested_optimizer": 1, "steps_per_print": 5},
    {"train_batch_size": 4, "fp16": {"enabled": True}, "zero_optimization": {"stage": 0, "cpu_offload": True},
     "checkpoint": {"tag_validation": "Ignore"}, "dataloader_drop_last": True, "communication_data_type": "fp16"},
    {"train_batch_size": 2, "zero_optimization": True},
    {"train_batch_size": 2, "bf16": {"enabled": True}, "managed_gradient_accumulation": False,
     "data_types": {"buffer_dtype": "bf16", "grad_accum_dtype": "fp32"}},
]
ATTRIBUTES = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "world_size",
              "zero_optimization_stage", "zero_enabled", "gradient_clipping", "steps_per_print", "optimizer_name",
              "optimizer_params", "scheduler_name", "scheduler_params", "zero_allow_untested_optimizer",
              "dataloader_drop_last", "communication_data_type", "prescale_gradients", "gradient_allreduce_op",
              "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail", "wall_clock_breakdown",
              "managed_gradient_accumulation", "grad_accum_dtype", "param_dtype", "buffer_dtype", "_param_dict"]
ZERO_FIELDS = ["stage", "overlap_comm", "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
               "param_persistence_threshold", "max_live_parameters", "max_reuse_distance", "sub_group_size",
               "gather_16bit_weights_on_model_save", "contiguous_gradients", "round_robin_gradients",
               "module_granularity_threshold", "zero_quantized_weights", "memory_efficient_linear"]


def _offload(section):
    return None if section is None else (section.device, section.pin_memory)


@pytest.mark.parametrize("config", CONFIGS)
def test_as_real_deepspeed(config, tmp_path: Path):
    real = pytest.importorskip("deepspeed.runtime.config")
    path = tmp_path / "ds_config.json"
    path.write_text(f"// a comment, as DeepSpeed's hjson allows\n{config!r}".replace("True", "true").replace("False", "false"))
    theirs = real.DeepSpeedConfig(dict(config))
    for ours in (DeepSpeedConfig(dict(config)), DeepSpeedConfig(str(path))):
        for name in ATTRIBUTES:
            if name == "steps_per_print" and name not in config:
                assert ours.steps_per_print == 10  # dsfunc's default (the README's table says so)
                continue
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.float16_config.enabled == theirs.float16_config.enabled
        assert ours.bfloat16_config.enabled == theirs.bfloat16_config.enabled
        for name in ZERO_FIELDS:
            assert getattr(ours.zero_config, name) == getattr(theirs.zero_config, name), name
        for name in ("offload_optimizer", "offload_param"):
            assert _offload(getattr(ours.zero_config, name)) == _offload(getattr(theirs.zero_config, name)), name


def test_zero_config_classes_as_real_deepspeed():
    real = pytest.importorskip("deepspeed.runtime.zero.config")
    for section in ({}, {"cpu_offload": True}, {"cpu_offload_param": True}, {"offload_param": {}, "offload_optimizer": {}},
                    {"stage": 3, "max_reuse_distance": 5, "stage3_gather_fp16_weights_on_model_save": True}):
        ours, theirs = DeepSpeedZeroConfig(**section), real.DeepSpeedZeroConfig(**section)
        for name in ZERO_FIELDS:
            assert getattr(ours, name) == getattr(theirs, name), (section, name)
        for name in ("offload_optimizer", "offload_param"):
            assert _offload(getattr(ours, name)) == _offload(getattr(theirs, name)), (section, name)
    for read, write in ((True, False), (False, True), (False, False)):
        values = {"pipeline_read": read, "pipeline_write": write}
        assert DeepSpeedZeroOffloadOptimizerConfig(**values).pipeline == \
            real.DeepSpeedZeroOffloadOptimizerConfig(**values).pipeline
    assert DeepSpeedZeroOffloadParamConfig().buffer_count == real.DeepSpeedZeroOffloadParamConfig().buffer_count
    assert [(s.name, int(s)) for s in ZeroStageEnum] == [(s.name, int(s)) for s in real.ZeroStageEnum]
    assert [e.value for e in OffloadDeviceEnum] == ["none", "cpu", "nvme"]


@pytest.mark.parametrize(
    "build, expected",
    [
        (lambda: DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 9}}),
         "zero_optimization.stage = 9 is invalid"),
        (lambda: DeepSpeedConfig({"train_batch_size": 8, "checkpoint": {"tag_validation": "foo"}}),
         'checkpoint.tag_validation = "foo" is invalid'),
        (lambda: DeepSpeedZeroConfig(stage3_prefetch_bucket_sise=1), 'Did you mean'),
        (lambda: DeepSpeedZeroOffloadOptimizerConfig(device="gpu"), 'device = "gpu" is invalid'),
    ],
)
def test_a_bad_config_is_deepspeeds_config_error(build, expected):
    with pytest.raises(dsfunc.DeepSpeedConfigError, match=expected):
        build()


def test_mpu_gives_the_data_parallel_size():
    class Mpu:
        def get_data_parallel_world_size(self) -> int:
            return 4

    config = DeepSpeedConfig({"train_batch_size": 32, "gradient_accumulation_steps": 2}, mpu=Mpu())
    assert (config.world_size, config.train_micro_batch_size_per_gpu) == (4, 4)


@pytest.mark.parametrize("triple, world, expected", [
    ((32, 16, None), 2, (32, 16, 1)), ((32, None, 2), 2, (32, 8, 2)), ((None, 8, 2), 2, (32, 8, 2)),
    ((33, 17, 2), 2, None), ((32, 18, None), 2, None), ((None, None, 2), 2, None),
])
def test_the_batch_triple_is_resolved_again_as_real_deepspeed(triple, world, expected):
    """Scripts that set the three attributes and call ``_configure_train_batch_size`` (DeepSpeed's own tests)."""
    real = pytest.importorskip("deepspeed.runtime.config")
    results = []
    for cls in (DeepSpeedConfig, real.DeepSpeedConfig):
        config = cls({"train_batch_size": 2})
        config.world_size = world
        config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = triple
        try:
            config._configure_train_batch_size()
            results.append((config.train_batch_size, config.train_micro_batch_size_per_gpu,
                            config.gradient_accumulation_steps))
        except AssertionError:
            results.append(None)
    assert results == [expected, expected]


def test_version_and_git_names():
    assert (dsfunc.__version_major__, dsfunc.__version_minor__, dsfunc.__version_patch__) == \
        tuple(int(p) for p in dsfunc.__version__.split(".")[:3])
    assert isinstance(dsfunc.__git_hash__, str) and isinstance(dsfunc.__git_branch__, str)


def test_other_names_of_the_modules_import_and_refuse_when_used():
    from dsfunc.runtime.config import ADAM_OPTIMIZER, get_bfloat16_config, get_pld_enabled
    from dsfunc.runtime.swap_tensor import MIN_SWAPPABLE_BYTES, AsyncPartitionedParameterSwapper
    from dsfunc.runtime.zero.config import read_zero_config_deprecated

    assert ADAM_OPTIMIZER == "adam" and get_bfloat16_config({"bf16": {"enabled": True}}).enabled  # as DeepSpeed's
    real = pytest.importorskip("deepspeed.runtime.swap_tensor")
    assert MIN_SWAPPABLE_BYTES == real.MIN_SWAPPABLE_BYTES
    for stand_in in (get_pld_enabled, read_zero_config_deprecated, AsyncPartitionedParameterSwapper):
        with pytest.raises(dsfunc.NotSupportedError, match="is not implemented by dsfunc"):
            stand_in({})


def test_schedule_param_names_are_deepspeeds():
    """The lr schedules' param names scripts import as config keys (``CYCLE_MIN_LR``, ...) are real DeepSpeed's."""
    real = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from dsfunc.runtime import lr_schedules

    names = [n for n, v in vars(real).items() if n.isupper() and isinstance(v, str)]
    assert len(names) > 25 and {n: getattr(lr_schedules, n) for n in names} == {n: getattr(real, n) for n in names}


PRECISION_DICTS = [{}, {"bf16": {"enabled": True}}, {"bfloat16": {"enabled": True}}, {"bf16": {"enabled": False}},
                   {"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 8, "hysteresis": 3}},
                   {"fp16": {"enabled": True, "loss_scale_window": 10, "min_loss_scale": 2}}]


@pytest.mark.parametrize("param_dict", PRECISION_DICTS)
def test_precision_sections_as_real_deepspeed(param_dict):
    real = pytest.importorskip("deepspeed.runtime.precision_config")
    ours_bf16, theirs_bf16 = get_bfloat16_config(param_dict), real.get_bfloat16_config(param_dict)
    assert ours_bf16.enabled == theirs_bf16.enabled
    ours, theirs = get_float16_config(param_dict), real.get_float16_config(param_dict)
    for field in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                  "consecutive_hysteresis", "min_loss_scale", "auto_cast"):
        assert getattr(ours, field) == getattr(theirs, field), field
    full = DeepSpeedConfig({"train_batch_size": 1, **param_dict})  # the same sections as the whole config's
    assert (ours_bf16, ours) == (full.bfloat16_config, full.float16_config)


def test_precision_sections_are_checked_by_the_one_parser():
    with pytest.raises(dsfunc.ConfigError, match='"bf16" and "bfloat16" are two spellings'):
        get_bfloat16_config({"bf16": {}, "bfloat16": {}})
    with pytest.raises(dsfunc.ConfigError, match='Unknown config key "fp16.scale_window"'):
        get_float16_config({"fp16": {"scale_window": 1}})
    with pytest.raises(dsfunc.ConfigError, match="bfloat16.loss_scale: loss scaling only applies to fp16"):
        get_bfloat16_config({"bfloat16": {"loss_scale": 1}})
