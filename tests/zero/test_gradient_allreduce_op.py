"""``gradient_allreduce_op: "sum"`` on two real ranks: the gradients are summed over the ranks (each still the
mean over the rank's micro-batches), so plain SGD at lr moves the weights as "mean" at world x lr does."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from tests.models import MLP, config, mlp_batches, relative_diff
from tests.multiprocess import run_world


def _train(rank: int, world: int, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for op, lr in (("sum", 0.05), ("mean", 0.05 * world), ("mean at lr", 0.05)):
        torch.manual_seed(0)
        cfg = config(micro=2, gas=2, world=world, stage=stage, gradient_allreduce_op=op.split()[0].upper(),
                     optimizer={"type": "SGD", "params": {"lr": lr}})
        state = dsfunc.init_state(MLP(), cfg)
        for x, y in mlp_batches(2, 4 * world):
            state = dsfunc.train_step(state, (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]))
        out[op] = dsfunc.full_params(state)
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_sum_is_world_times_mean(stage):
    for got in run_world(_train, 2, stage):
        assert relative_diff(got["sum"], got["mean"]) < 1e-6
        assert relative_diff(got["sum"], got["mean at lr"]) > 1e-3  # the test can tell them apart


def test_sum_at_stage_3_is_refused_as_in_deepspeed():
    with pytest.raises(dsfunc.ConfigError, match='gradient_allreduce_op = "sum" is not supported with ZeRO stage 3'):
        dsfunc.Config.load(config(stage=3, gradient_allreduce_op="sum"))
