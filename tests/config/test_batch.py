"""The batch triple: DeepSpeed's inference, its checks and their messages, the world size."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsfunc.config import BF16Config, Config, ConfigError, FP16Config, ZeroConfig
from tests.config.helpers import error, load
from tests.multiprocess import run_world

RULE = "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"


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
