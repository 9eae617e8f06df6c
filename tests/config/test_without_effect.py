"""ZeRO keys dsfunc accepts but does not use: one start-up line names them, once per process."""

from __future__ import annotations

import logging

import pytest

import dsfunc
from dsfunc.config import announce, precision, zero
from tests.config.helpers import error, load
from tests.models import MLP, config
from tests.multiprocess import run_world

TUTORIAL_ZERO = {
    "stage": 2,
    "allgather_partitions": True,
    "allgather_bucket_size": 2e8,
    "reduce_scatter": True,
    "reduce_bucket_size": 2e8,
    "overlap_comm": True,
    "contiguous_gradients": True,
}


def test_the_line_names_every_key_given_and_why():
    [line] = load({"zero_optimization": TUTORIAL_ZERO}).without_effect()
    assert line.startswith(
        "zero_optimization: allgather_partitions, allgather_bucket_size, reduce_scatter, "
        "contiguous_gradients have no effect in dsfunc ("
    )
    for key in ("allgather_partitions", "allgather_bucket_size", "reduce_scatter", "contiguous_gradients"):
        assert f"{key}: {zero.WITHOUT_EFFECT[key]}" in line
    assert "reduce_bucket_size" not in line and "overlap_comm" not in line


@pytest.mark.parametrize("key", sorted(zero.WITHOUT_EFFECT))
def test_each_key_at_any_value_is_named(key):
    sizes = {"allgather_bucket_size": 1, "stage3_max_reuse_distance": 0, "sub_group_size": 7,
             "stage3_module_granularity_threshold": 0}
    value = sizes.get(key, False)
    assert load({"zero_optimization": {key: value}}).without_effect() == [
        f"zero_optimization: {key} has no effect in dsfunc ({key}: {zero.WITHOUT_EFFECT[key]})."
    ]


def test_the_short_spelling_is_named_as_given():
    [line] = load({"zero_optimization": {"stage": 3, "max_reuse_distance": 1e9}}).without_effect()
    assert line.startswith("zero_optimization: max_reuse_distance has no effect in dsfunc (max_reuse_")


@pytest.mark.parametrize(
    "extra",
    [{}, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e7}}, {"zero_optimization": True}],
)
def test_a_config_without_them_says_nothing(extra):
    assert load(extra).without_effect() == []


@pytest.mark.parametrize(
    "zero_section, expected",
    [
        ({"reduce_scatter": 1}, "zero_optimization.reduce_scatter = 1 is invalid: expected true or false"),
        ({"allgather_bucket_size": "5e8"}, 'zero_optimization.allgather_bucket_size = "5e8" is invalid'),
        ({"sub_group_size": -1}, "sub_group_size = -1 is invalid: expected an integer >= 0"),
        ({"ignore_unused_parameters": "false"}, "ignore_unused_parameters = \"false\" is invalid"),
        ({"max_reuse_distance": 1.5}, "zero_optimization.max_reuse_distance = 1.5 is invalid"),
    ],
)
def test_a_bad_type_is_still_an_error(zero_section, expected):
    assert expected in error({"train_batch_size": 8, "zero_optimization": zero_section})


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"bf16": {"enabled": True, "immediate_grad_update": True}},
         (f"bf16: immediate_grad_update has no effect in dsfunc (immediate_grad_update: "
          f"{precision.BF16_WITHOUT_EFFECT['immediate_grad_update']}).")),
        ({"bf16": {"enabled": True, "check_grad_overflow": False}}, "bf16: check_grad_overflow has no effect"),
        ({"pipeline": {"use_reentrant": False}}, "pipeline: use_reentrant has no effect in dsfunc (use_reentrant: "),
        ({"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 100}},
         "zero_optimization: stage3_module_granularity_threshold has no effect"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
         "zero_optimization: offload_optimizer has no effect in dsfunc at stage 0 (nor in DeepSpeed"),
        ({"zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}}},
         "zero_optimization: offload_param has no effect in dsfunc at stage 0 (nor in DeepSpeed"),
        ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_param": {"device": "cpu"}}},
         "zero_optimization: offload_param has no effect in dsfunc at stage 2"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},  # DeepSpeed accepts it alone
         "zero_optimization: offload_param has no effect in dsfunc without offload_optimizer"),
    ],
)
def test_keys_of_other_sections_are_named(extra, expected):
    [line] = load(extra).without_effect()
    assert line.startswith(expected)


def test_offload_where_it_is_used_says_nothing():
    zero_section = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert load({"zero_optimization": zero_section}).without_effect() == []


def test_init_state_logs_the_line_once_per_process(caplog, monkeypatch):
    monkeypatch.setattr(announce, "_SAID", set())
    cfg = config(stage=2, zero_optimization={"stage": 2, "contiguous_gradients": True, "sub_group_size": 1e9})
    with caplog.at_level(logging.WARNING, logger="dsfunc"):
        dsfunc.init_state(MLP(), cfg)
        dsfunc.init_state(MLP(), cfg)
    said = [r for r in caplog.records if r.name == "dsfunc" and "no effect in dsfunc" in r.getMessage()]
    expected = load({"zero_optimization": cfg["zero_optimization"]}).without_effect()
    assert [r.getMessage() for r in said] == expected
    assert expected[0].startswith("zero_optimization: contiguous_gradients, sub_group_size have no effect")


def test_init_state_with_an_untouched_config_logs_nothing(caplog, monkeypatch):
    monkeypatch.setattr(announce, "_SAID", set())
    with caplog.at_level(logging.DEBUG, logger="dsfunc"):
        dsfunc.init_state(MLP(), config(stage=1))
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]


def _lines_said(rank: int, world_size: int) -> list[str]:
    """init_state on a real two-rank group, with a handler of this process's own on the dsfunc logger."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dsfunc").addHandler(handler)
    cfg = config(micro=2, world=world_size, stage=2)
    cfg["zero_optimization"] = {"stage": 2, "round_robin_gradients": False}
    dsfunc.init_state(MLP(), cfg)
    return [r.getMessage() for r in records if "no effect in dsfunc" in r.getMessage()]


def test_only_rank_0_says_it():
    rank0, rank1 = run_world(_lines_said, 2)
    key = "round_robin_gradients"
    assert rank0 == [f"zero_optimization: {key} has no effect in dsfunc ({key}: {zero.WITHOUT_EFFECT[key]})."]
    assert rank1 == []
