"""``"managed_gradient_accumulation": false`` under real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks) and under dsfunc: every
``engine.step()`` applies the update of the backwards since the last one, whatever their count, at ZeRO stages 0-3
(SGD with momentum, clipping): the same steps applied, ``global_steps``/``global_samples``, returned losses and
parameters; ``is_gradient_accumulation_boundary()`` False outside ``step()``; ``set_gradient_accumulation_boundary``
is refused. What DeepSpeed refuses with it, dsfunc refuses."""

from __future__ import annotations

import pytest
from torch import nn

from dsfunc.config import Config
from dsfunc.deepspeed import initialize
from tests.deepspeed.test_against_deepspeed import ROOT, both_sides

SCRIPT = f"{ROOT}/tests/deepspeed/scripts/ds_unmanaged.py"
BACKWARDS = (2, 5, 3)  # the script's backwards per step


def test_unmanaged_accumulation_as_deepspeed(tmp_path):
    for rank, (ds, ours) in enumerate(both_sides(tmp_path, SCRIPT)):
        assert sorted(ours) == sorted(ds) == [0, 1, 2, 3]
        for stage, expected in ds.items():
            got = ours[stage]
            assert expected["applied"] == [True] * 3 and expected["boundary_refused"]
            assert expected["boundary"] == [False] * (sum(BACKWARDS) + len(BACKWARDS))  # True only inside step()
            for key in ("applied", "global_steps", "global_samples", "boundary_refused", "boundary"):
                assert got[key] == expected[key], (rank, stage, key)
            assert got["returned"] == pytest.approx(expected["returned"], rel=1e-5), (rank, stage)
            for name, value in expected["params"].items():
                assert (got["params"][name] - value).abs().max() / value.abs().max() < 1e-5, (rank, stage, name)


def test_unmanaged_accumulation_refusals():
    assert Config.load({"train_micro_batch_size_per_gpu": 1}).managed_gradient_accumulation
    config = {"train_micro_batch_size_per_gpu": 1, "managed_gradient_accumulation": False,
              "zero_optimization": {"stage": 1, "overlap_comm": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(AssertionError, match="overlap_comm only with ZeRO stage 2"):  # DeepSpeed asserts
        initialize(model=nn.Linear(2, 2), config=config)
