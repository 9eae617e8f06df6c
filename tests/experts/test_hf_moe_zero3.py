"""A Hugging Face MoE model (tiny Qwen3-MoE, AutoEP off) trains under ZeRO-3 on 2 ranks (gloo) with no leaf-module
declaration in its config, like the unmodified model in one process, also when every token of a rank goes to the
same two experts (the other experts get none of that rank's tokens): no hang, same losses and parameters."""

from __future__ import annotations

import pytest

import dsfunc
from dsfunc.zero.leaf import z3_leaf_module
from tests.experts import hf_moe
from tests.multiprocess import run_world

STEPS = 3


def _train(rank: int, world: int, one_token: bool) -> dict:
    model = hf_moe.build("qwen3_moe")
    state = dsfunc.init_state(model, hf_moe.config(world, "sgd", zero_optimization={"stage": 3}))
    losses = []
    for step in range(STEPS):
        ids = hf_moe.batch(step, hf_moe.MICRO * world, one_token=one_token).split(hf_moe.MICRO)[rank]
        state = dsfunc.train_step(state, {"input_ids": ids, "labels": ids})
        losses.append(float(state.metrics.loss))
    return {"losses": losses, "params": dsfunc.full_params(state), "leaf": z3_leaf_module(model.model.layers[0].mlp)}


@pytest.mark.parametrize("one_token", [False, True])
def test_zero3_trains_an_hf_moe_model_like_one_process(one_token):
    results = run_world(_train, 2, one_token)
    losses, params = hf_moe.reference("qwen3_moe", 2, "sgd", STEPS, one_token=one_token)
    mean = [sum(r["losses"][i] for r in results) / 2 for i in range(STEPS)]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mean, losses)), (mean, losses)
    for r in results:
        assert r["leaf"]  # DeepSpeed's default leaf classes name the HF block: the config need not
        for name, value in params.items():
            assert hf_moe.relative(r["params"][name], value) <= 1e-5, name
