"""The zero_optimization section: defaults, legacy forms and aliases, offload, ZeRO features dsfunc lacks."""

from __future__ import annotations

import pytest

from dsfunc.config import ZeroConfig
from dsfunc.config.offload import OPTIMIZER_DEFAULTS, PARAM_DEFAULTS, OffloadConfig
from tests.config.helpers import error, load


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


def test_legacy_zero_bool():
    assert load({"zero_optimization": True}).zero_optimization == ZeroConfig(stage=1)
    assert load({"zero_optimization": False}).zero_optimization == ZeroConfig(stage=0)


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
        {"memory_efficient_linear": True},
        {"memory_efficient_linear": False},  # DeepSpeed-Chat's configs
        {"override_module_apply": False},
        {"stage3_model_persistence_threshold": 2**63 - 1},
        {"elastic_checkpoint": False},
        {"elastic_checkpoint": True},  # without effect: dsfunc checkpoints always reshard
        {"leaf_module": {}},
    ],
)
def test_zero_keys_at_default_are_accepted(zero):
    assert load({"zero_optimization": {"stage": 3, **zero}}).zero_optimization == ZeroConfig(stage=3)


@pytest.mark.parametrize(
    "zero, expected",
    [
        (
            {"offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
            ('zero_optimization.offload_param.device = "nvme": offloading parameters to NVMe (ZeRO-Infinity) is '
            'not built in dsfunc; use "device": "cpu"'),
        ),
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
         "zero_optimization.offload_optimizer.ratio = 0.5: dsfunc's offload to the CPU has no use for it"),
        ({"offload_optimizer": {"device": "cpu", "nvme_path": "/nvme"}}, 'offload_optimizer.nvme_path = "/nvme"'),
        ({"offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5}}, "Remove the key or set it to 0.8"),
        ({"offload_param": {"device": "cpu", "offload_optimizer": 1}}, 'Unknown config key "zero_optimization.'),
        ({"offload_optimizer": {"device": "GPU"}}, 'device = "GPU" is invalid: expected "none", "cpu" or "nvme"'),
        ({"cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
         "zero_optimization.cpu_offload and zero_optimization.offload_optimizer are two spellings"),
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
        ({"zeropp_loco_param": None}, "zero_optimization.zeropp_loco_param: LoCo-ZeRO++ has been removed"),
        (
            {"mics_shard_size": -1},
            ('MiCS ZeRO-3 sharding has been removed. DeepSpeed 0.19.8 refuses this key too: remove '
            '"zero_optimization.mics_shard_size"'),
        ),
        ({"legacy_stage1": True}, "legacy ZeRO stage 1"),
        ({"leaf_module": {"classes": [3]}}, "zero_optimization.leaf_module.classes = [3] is invalid"),
        (
            {"model_persistence_threshold": 10},
            "zero_optimization.model_persistence_threshold = 10: dsfunc does not support",
        ),
    ],
)
def test_zero_features_dsfunc_lacks(zero, expected):
    assert expected in error({"train_batch_size": 8, "zero_optimization": {"stage": 3, **zero}})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_to_cpu_is_on_at_stages_1_to_3(stage):
    section = {"device": "cpu", "pin_memory": False, "buffer_count": 4, "ratio": 1, "fast_init": False}
    z = load({"zero_optimization": {"stage": stage, "offload_optimizer": section}}).zero_optimization
    assert z.offload_optimizer == OffloadConfig(device="cpu", pin_memory=False) and z.offload_param is None
    both = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "max_in_cpu": 1e9}}
    z = load({"zero_optimization": both}).zero_optimization
    assert z.offload_optimizer == z.offload_param == OffloadConfig(device="cpu", pin_memory=True)
    assert load({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}}}).zero_optimization \
        == ZeroConfig()


def test_deprecated_cpu_offload_spellings_are_the_sections():
    """DeepSpeed reads cpu_offload / cpu_offload_param (and cpu_offload_use_pin_memory) as the sections."""
    z = load({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                    "cpu_offload_use_pin_memory": False}}).zero_optimization
    assert z.offload_optimizer == z.offload_param == OffloadConfig(device="cpu", pin_memory=False)
    assert load({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization == ZeroConfig(stage=2)
    assert "cpu_offload = 1 is invalid" in error({"train_batch_size": 8, "zero_optimization": {"cpu_offload": 1}})


@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 0, "offload_optimizer": {"device": "cpu"}},
        {"stage": 0, "offload_param": {"device": "cpu"}},
        {"stage": 1, "offload_param": {"device": "cpu"}},
        {"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    ],
)
def test_offload_below_the_stage_that_uses_it_has_no_effect(zero):
    """DeepSpeed 0.19.8 accepts and ignores these: its initialize builds a plain torch AdamW at stage 0 with either
    section on, and at stages 1-2 with offload_param on its engine's zero_offload_param() is set but nothing reads
    it (seen by running it with DS_ACCELERATOR=cpu)."""
    z = load({"zero_optimization": zero}).zero_optimization
    assert z.offload_param is None
    assert z.offload_optimizer == (OffloadConfig() if "offload_optimizer" in zero and zero["stage"] else None)


def test_offload_to_nvme_is_an_error():
    zero = {"stage": 1, "offload_optimizer": {"device": "nvme"}}
    assert 'use "device": "cpu" (host memory) or "none"' in error({"train_batch_size": 8, "zero_optimization": zero})


def test_offload_defaults_are_deepspeeds():
    """The keys that must keep their default under CPU offload have DeepSpeed 0.19.8's defaults."""
    offload_config = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    optimizer = offload_config.DeepSpeedZeroOffloadOptimizerConfig()
    param = offload_config.DeepSpeedZeroOffloadParamConfig()
    for defaults, ds in ((OPTIMIZER_DEFAULTS, optimizer), (PARAM_DEFAULTS, param)):
        assert {key: getattr(ds, key) for key in defaults} == dict(defaults)
    assert optimizer.pin_memory is param.pin_memory is True and OffloadConfig().pin_memory is True
