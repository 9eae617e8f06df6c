"""AutoEP composed with AutoTP: a tiny Hugging Face MoE model on 4 gloo ranks at ``tensor_parallel.autotp_size`` 2
(attention split over tp, dp 2) and ``expert_parallel.autoep_size`` 2 (experts split over DeepSpeed's ep groups,
blocks of consecutive ranks: here the tp groups, each expert replicated over its dp ranks), at ZeRO 1 and 2, trains
like the unmodified model in one process on the same global batches (3 steps, clipped; SGD with momentum and
AdamW): losses within 1e-5, every parameter within 1e-4. DeepSpeed's MoE layer under tp and any MoE under
sequence parallelism are refused by name."""

from __future__ import annotations

import pytest
import torch

import dsfunc
import dsfunc.parallel
from dsfunc.experts import MoE
from dsfunc.experts.ep_block import ExpertParallelBlock
from tests.experts import hf_moe
from tests.multiprocess import run_world

STEPS = 3
REPLICAS = 2  # 4 ranks at tp 2


def _train(rank: int, world: int, family: str, optimizer: str, stage: int) -> dict:
    model = hf_moe.build(family)
    config = hf_moe.config(REPLICAS, optimizer, expert_parallel={"enabled": True, "autoep_size": 2},
                           tensor_parallel={"autotp_size": 2}, zero_optimization={"stage": stage})
    state = dsfunc.init_state(model, config)
    mesh = state.program.mesh
    block = next(m for m in model.modules() if isinstance(m, ExpertParallelBlock))
    losses = []
    for step in range(STEPS):
        ids = hf_moe.batch(step, hf_moe.MICRO * REPLICAS).split(hf_moe.MICRO)[mesh.group("dp").rank]
        state = dsfunc.train_step(state, {"input_ids": ids, "labels": ids})
        losses.append(float(state.metrics.loss))
    where = dsfunc.parallel.placements(state)["model.layers.0.self_attn.q_proj.weight"]["tp"]
    return {"losses": losses, "params": dsfunc.full_params(state), "local": block.experts.num_local,
            "groups": (mesh.group("tp").ranks, mesh.group("dp").ranks, block.groups.ep_ranks,
                       block.groups.data_ranks), "q_proj": where}


@pytest.mark.parametrize(("family", "optimizer", "stage"), [("mixtral", "sgd", 1), ("qwen3_moe", "adamw", 2)])
def test_tp2_ep2_dp2_equals_one_process(family, optimizer, stage):
    results = run_world(_train, 4, family, optimizer, stage, timeout=900)
    losses, params = hf_moe.reference(family, REPLICAS, optimizer, STEPS)
    # tp innermost, ep groups the blocks of 2 consecutive ranks (DeepSpeed's), dp and expert-data-parallel strided
    assert [r["groups"] for r in results] == [((0, 1), (0, 2), (0, 1), (0, 2)), ((0, 1), (1, 3), (0, 1), (1, 3)),
                                              ((2, 3), (0, 2), (2, 3), (0, 2)), ((2, 3), (1, 3), (2, 3), (1, 3))]
    for r in results:
        assert r["local"] == 2 and r["q_proj"] == "Shard(dim=0)"
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], losses)), (r["losses"], losses)
        assert r["params"].keys() == params.keys()
        for name, value in params.items():
            assert hf_moe.relative(r["params"][name], value) <= 1e-4, name


def _refusals(rank: int, world: int) -> list[str]:
    """What init_state says on 2 ranks to DeepSpeed's MoE layer at tp 2, and to AutoEP at sp 2."""
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2))
    cases = [(layer, {"tensor_parallel": {"autotp_size": 2}}),
             (hf_moe.build("mixtral"), {"sequence_parallel_size": 2, "expert_parallel": {"enabled": True}})]
    out = []
    for model, sections in cases:
        try:
            dsfunc.init_state(model, hf_moe.config(1, "sgd", **sections), loss_fn=lambda m, b: m(b).sum())
        except dsfunc.NotSupportedError as e:
            out.append(str(e))
    torch.distributed.barrier()  # no rank leaves while another still builds the mesh's groups
    return out


def test_moe_layer_under_tp_and_moe_under_sp_are_refused_by_name():
    for layer, sp in run_world(_refusals, 2, timeout=600):
        assert "deepspeed.moe.layer.MoE with tensor_parallel.autotp_size 2 is not supported" in layer, layer
        assert "What composes with tp is AutoEP" in layer, layer
        assert "mixture-of-experts layers with sequence_parallel_size 2 are not supported" in sp, sp
        assert "load-balancing loss" in sp, sp
