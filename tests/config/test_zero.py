"""The zero_optimization section: defaults, legacy forms and aliases, ZeRO features dsfunc lacks."""

from __future__ import annotations

import pytest

from dsfunc.config import ZeroConfig
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
        {"leaf_module": {}},
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
        ({"zeropp_loco_param": None}, "zero_optimization.zeropp_loco_param: LoCo-ZeRO++ has been removed"),
        (
            {"mics_shard_size": -1},
            ('MiCS ZeRO-3 sharding has been removed. DeepSpeed 0.19.8 refuses this key too: remove '
            '"zero_optimization.mics_shard_size"'),
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
