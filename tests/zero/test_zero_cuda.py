"""ZeRO on GPUs with NCCL (skips without two CUDA devices): every stage matches a one-GPU run in fp32,
and bf16 stage 3 trains with at most two units gathered."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from tests.models import MLP, config, mlp_batches, relative_diff
from tests.multiprocess import run_world

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def train(rank: int, world: int, stages: list[int], precision: str | None) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        cfg = config(micro=2, gas=2, world=world, stage=stage)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if precision:
            cfg[precision] = {"enabled": True}
        state = dsfunc.init_state(MLP(width=64, depth=4), cfg, device=device)
        n = 4
        for x, y in mlp_batches(10, n * world):
            state = dsfunc.train_step(state, (x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        out[stage] = ({k: v.cpu() for k, v in dsfunc.full_params(state).items()},
                      state.program.run.workspace.stats.max_live_units, state.metrics.loss.item())
    return out


@needs_two_gpus
def test_nccl_stages_match_one_gpu_in_fp32():
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(width=64, depth=4), config(micro=2, gas=4), device="cuda:0")
    for batch in mlp_batches(10, 8):
        state = dsfunc.train_step(state, batch)
    reference = {k: v.cpu() for k, v in dsfunc.full_params(state).items()}
    results = run_world(train, 2, [0, 1, 2, 3], None, backend="nccl")
    for per_stage in results:
        for stage, (full, _, _) in per_stage.items():
            assert relative_diff(full, reference) < 1e-5, stage


@needs_two_gpus
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nccl_mixed_precision_stage3(precision):
    results = run_world(train, 2, [2, 3], precision, backend="nccl")
    for per_stage in results:
        (full2, _, loss2), (full3, live3, loss3) = per_stage[2], per_stage[3]
        assert live3 <= 2
        assert relative_diff(full3, full2) < 1e-2 and abs(loss2 - loss3) < 1e-2
