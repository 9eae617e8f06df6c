"""Ulysses sequence parallelism through ``init_state``/``train_step`` trains a tiny Hugging Face Llama (GQA) like
one process on the same global batch: at sp 2 and sp 2 x dp 2, with AdamW + clipping and SGD with momentum."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from tests.multiprocess import run_world
from tests.parallel.ulysses_setup import ADAMW, GAS, SGD, STEPS, config, llama, replica_batch

pytest.importorskip("transformers")


def _train(rank: int, world: int, optimizer: dict, sp: int, stage: int) -> tuple[list[float], dict]:
    dp = world // sp
    state = dsfunc.init_state(llama(), config(optimizer, sp=sp, stage=stage))
    losses = []
    for step in range(STEPS):
        state = dsfunc.train_step(state, replica_batch(step, rank // sp))
        losses.append(state.metrics.loss.item())
    assert dp == state.program.config.world_size  # the batch sizes count the data-parallel replicas
    return losses, dsfunc.full_params(state)


def _reference(dp: int, optimizer: dict) -> tuple[list[float], dict]:
    """One process: every replica's micro-batches in one step (the mean over them is the mean over replicas)."""
    state = dsfunc.init_state(llama(), config(optimizer, gas=GAS * dp))
    losses = []
    for step in range(STEPS):
        batches = [replica_batch(step, r) for r in range(dp)]
        batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        state = dsfunc.train_step(state, batch)
        losses.append(state.metrics.loss.item())
    return losses, dsfunc.full_params(state)


@pytest.mark.parametrize("world, sp, stage", [(2, 2, 0), (4, 2, 2)], ids=["sp2", "sp2xdp2-zero2"])
@pytest.mark.parametrize("optimizer", [ADAMW, SGD], ids=["adamw-clip", "sgd-momentum"])
def test_trains_like_one_process(world, sp, stage, optimizer):
    results = run_world(_train, world, optimizer, sp, stage, timeout=600)
    want_losses, want = _reference(world // sp, optimizer)
    for losses, params in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) < 1e-5, (losses, want_losses)
        assert params.keys() == want.keys()
        for name, value in want.items():
            assert ((params[name] - value).norm() / value.norm()).item() < 1e-4, name
    assert want_losses[-1] < want_losses[0]  # it trains
