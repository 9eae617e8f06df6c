"""Ulysses sequence parallelism through ``init_state``/``train_step`` trains a tiny Hugging Face Llama (GQA) like
one process on the same global batch: at sp 2 and sp 2 x dp 2, with AdamW + clipping and SGD with momentum."""

from __future__ import annotations

import pytest

import dsfunc
from tests.multiprocess import run_world
from tests.parallel.ulysses_setup import ADAMW, SGD, STEPS, config, llama, one_process, replica_batch

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


@pytest.mark.parametrize("world, sp, stage", [(2, 2, 0), (4, 2, 2)], ids=["sp2", "sp2xdp2-zero2"])
@pytest.mark.parametrize("optimizer", [ADAMW, SGD], ids=["adamw-clip", "sgd-momentum"])
def test_trains_like_one_process(world, sp, stage, optimizer):
    results = run_world(_train, world, optimizer, sp, stage, timeout=600)
    want_losses, want, _ = one_process(optimizer, [[replica_batch(s, r) for r in range(world // sp)]
                                                   for s in range(STEPS)])
    for losses, params in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) < 1e-5, (losses, want_losses)
        assert params.keys() == want.keys()
        for name, value in want.items():
            assert ((params[name] - value).norm() / value.norm()).item() < 1e-4, name
    assert want_losses[-1] < want_losses[0]  # it trains
