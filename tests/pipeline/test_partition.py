"""Stage boundaries: DeepSpeed's own partition functions are the reference; the errors name what is wrong."""

from __future__ import annotations

import random

import pytest
from torch import nn

from dsfunc.errors import InputError
from dsfunc.pipeline import LayerSpec, StageModule
from dsfunc.pipeline.partition import partition, partition_balanced, partition_uniform
from dsfunc.pipeline.topology import check_world


def test_boundaries_are_deepspeeds():
    utils = pytest.importorskip("deepspeed.runtime.utils", reason="real DeepSpeed is the reference")
    rng = random.Random(0)
    for _ in range(200):
        n, parts = rng.randint(1, 12), rng.randint(1, 5)
        weights = [rng.choice([0, 1, 3, 10, 64, 100]) for _ in range(n)]
        assert partition_uniform(n, parts) == utils.partition_uniform(n, parts)
        assert partition_balanced(weights, parts) == [int(b) for b in utils.partition_balanced(weights, parts)]


def test_partition_methods_on_a_layer_list():
    layers = [LayerSpec(nn.Embedding, 100, 8), LayerSpec(nn.Linear, 8, 8), nn.ReLU(), LayerSpec(nn.Linear, 8, 8),
              LayerSpec(nn.Linear, 8, 8)]
    assert StageModule(layers, stages=2, partition_method="uniform").parts == [0, 3, 5]
    assert StageModule(layers, stages=2, partition_method="parameters").parts == [0, 1, 5]  # the embedding alone
    assert StageModule(layers, stages=2, partition_method="type:linear").parts == [0, 4, 5]  # 2 + 1: ties split late
    stage = StageModule(layers, stages=2, stage=1, partition_method="uniform")
    assert list(stage.state_dict()) == ["3.weight", "3.bias", "4.weight", "4.bias"]  # global layer names


def test_the_named_errors():
    with pytest.raises(InputError, match="3 pipeline layers do not divide over 4 stages"):
        partition("uniform", 4, ["A", "B", "C"], [1, 1, 1])
    with pytest.raises(InputError, match="matches none of the layer classes"):
        partition("type:Conv", 2, ["Linear", "ReLU"], [0, 0])
    with pytest.raises(InputError, match="is not one of"):
        partition("best", 2, ["Linear", "ReLU"], [0, 0])
    with pytest.raises(InputError, match="world size 6 is not divisible by the 4 pipeline stages"):
        check_world(4, 6)
    assert check_world(2, 4) == 2
