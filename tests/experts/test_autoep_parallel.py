"""AutoEP trains like one process: a tiny Qwen3-MoE, Mixtral and DeepSeek-V3, their experts split over 2 ranks (ep 2)
and over 2 x 2 ranks (ep 2, each slice replicated on 2 data-parallel ranks; at ZeRO 0, 2 and 3: the experts sharded
over their expert-data-parallel ranks, the rest over all), on gloo, equal to the unmodified
Hugging Face model trained in one process on the same global batches (same initial weights, AdamW or SGD with
momentum, gradient clipping on). A checkpoint of ep 2 loads in one process and trains on as the HF model."""

from __future__ import annotations

import pytest
import torch

import dsfunc
import dsfunc.parallel
from dsfunc.experts.ep_block import ExpertParallelBlock
from tests.experts import hf_moe
from tests.multiprocess import run_world

STEPS = 3


def _train(rank: int, world: int, family: str, ep: int, optimizer: str, one_token: bool, stage: int = 0,
           folder: str | None = None) -> dict:
    model = hf_moe.build(family)
    config = hf_moe.config(world, optimizer, expert_parallel={"enabled": True, "autoep_size": ep},
                           zero_optimization={"stage": stage})
    state = dsfunc.init_state(model, config)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelBlock)]
    losses, counts = [], []
    for step in range(STEPS):
        ids = hf_moe.batch(step, hf_moe.MICRO * world, one_token=one_token).split(hf_moe.MICRO)[rank]
        with torch.no_grad():  # the experts this rank's tokens go to, by the model's own router
            logits = model(input_ids=ids).router_logits
        counts.append([torch.bincount(torch.topk(x, 2).indices.flatten(), minlength=4).tolist() for x in logits])
        state = dsfunc.train_step(state, {"input_ids": ids, "labels": ids})
        losses.append(float(state.metrics.loss))
    if folder is not None:
        dsfunc.save_checkpoint(state, folder)
    units = {u.name: u.group is not None for u in state.program.plan.units}
    return {"losses": losses, "params": dsfunc.full_params(state), "units": units, "counts": counts,
            "local": blocks[0].experts.gate_up_proj.shape[0], "where": dsfunc.parallel.placements(state)}


def _check(results: list[dict], family: str, world: int, ep: int, optimizer: str, one_token: bool = False,
           stage: int = 0) -> None:
    losses, params = hf_moe.reference(family, world, optimizer, STEPS, one_token=one_token)
    mean = [sum(r["losses"][i] for r in results) / world for i in range(STEPS)]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mean, losses)), (mean, losses)
    experts = next(name for name in results[0]["units"] if name.endswith(".mlp.experts"))
    assert results[0]["units"][experts] is (world > 1)
    for rank, r in enumerate(results):
        assert r["local"] == 4 // ep
        # placements: the experts split over their ep block on dim 0, ZeRO-sharded over their strided replicas
        block, replicas = tuple(range(rank - rank % ep, rank - rank % ep + ep)), tuple(range(rank % ep, world, ep))
        zero = f"Shard(0) of the flat unit {experts!r} over ranks {replicas}" if stage and len(replicas) > 1 else \
            "Replicate()"
        assert r["where"][f"{experts}.gate_up_proj"] == {"tp": "Replicate()", "ep": f"Shard(dim=0) over ranks {block}",
                                                        "edp": zero}, r["where"]
        assert r["where"]["model.norm.weight"] == {"tp": "Replicate()", "dp_sp": "Shard(0) of the flat unit 'root'"
                                                   if stage else "Replicate()"}, r["where"]
        assert params.keys() <= r["params"].keys()  # (and DeepSeek-V3's router bias, a buffer)
        for name, value in params.items():  # every rank's experts: full_params is the whole model
            assert hf_moe.relative(r["params"][name], value) <= 1e-4, name


@pytest.mark.parametrize(("family", "optimizer"), [("qwen3_moe", "adamw"), ("deepseek_v3", "sgd")])
def test_ep2_equals_one_process_and_its_checkpoint_loads_at_ep1(tmp_path, family, optimizer):
    results = run_world(_train, 2, family, 2, optimizer, False, 0, str(tmp_path))
    _check(results, family, 2, 2, optimizer)
    # each rank saved its slice of the stacked experts: one process (AutoEP of 1) reads them all, optimizer state too
    config = hf_moe.config(2, optimizer, expert_parallel={"enabled": True, "autoep_size": 1})
    state, _ = dsfunc.load_checkpoint(tmp_path, dsfunc.init_state(hf_moe.build(family), config))
    loaded = dsfunc.full_params(state)
    assert loaded.keys() == results[0]["params"].keys()
    assert all(torch.equal(loaded[k], v) for k, v in results[0]["params"].items())
    ids = hf_moe.batch(STEPS, hf_moe.MICRO * 2)
    state = dsfunc.train_step(state, {"input_ids": ids, "labels": ids})
    _, params = hf_moe.reference(family, 2, optimizer, STEPS + 1)
    full = dsfunc.full_params(state)
    assert all(hf_moe.relative(full[k], v) <= 1e-4 for k, v in params.items())


@pytest.mark.parametrize(("family", "optimizer", "stage"), [("qwen3_moe", "sgd", 3), ("mixtral", "adamw", 2)])
def test_ep2_dp2_equals_one_process(family, optimizer, stage):
    _check(run_world(_train, 4, family, 2, optimizer, False, stage), family, 4, 2, optimizer, stage=stage)


def test_an_expert_without_tokens_on_a_rank_neither_hangs_nor_differs():
    # SGD: attention over one repeated token leaves q and k with rounding noise for gradients, which Adam would
    # blow up to full-size steps
    results = run_world(_train, 2, "qwen3_moe", 2, "sgd", True)
    idle = [c for r in results for step in r["counts"] for c in step if 0 in c]
    assert len(idle) == 2 * STEPS * 2, "every rank routes its tokens to two experts only, in every layer and step"
    _check(results, "qwen3_moe", 2, 2, "sgd", one_token=True)
