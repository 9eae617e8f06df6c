"""AutoEP composed with AutoTP: a tiny Hugging Face Mixtral and Qwen3-MoE on 4 gloo ranks at
``tensor_parallel.autotp_size`` 2 (attention split over tp, Qwen3's per-head norms' gradients all-reduced over it,
dp 2) with their experts split over DeepSpeed's ep groups (blocks of ``autoep_size`` consecutive ranks): at ep 2
(the tp groups, each expert replicated over its dp ranks) at ZeRO 1 and 2, and at ep 4 (across both tp groups) at
ZeRO 3, train like the unmodified model in one process on the same global batches (3 steps clipped below the
gradients' norm, so an expert counted twice or missed would change every step; SGD with momentum and AdamW):
losses within 1e-5, every parameter within 1e-4. DeepSpeed's MoE layer under tp and any MoE under sequence
parallelism are refused by name."""

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


def _train(rank: int, world: int, family: str, optimizer: str, stage: int, ep: int) -> dict:
    model = hf_moe.build(family)
    config = hf_moe.config(REPLICAS, optimizer, expert_parallel={"enabled": True, "autoep_size": ep},
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


@pytest.mark.parametrize(("family", "optimizer", "stage", "ep"),
                         [("mixtral", "sgd", 1, 2), ("qwen3_moe", "adamw", 2, 2), ("qwen3_moe", "sgd", 3, 4)])
def test_tp2_dp2_with_autoep_equals_one_process(family, optimizer, stage, ep):
    results = run_world(_train, 4, family, optimizer, stage, ep, timeout=900)
    losses, params = hf_moe.reference(family, REPLICAS, optimizer, STEPS)
    for rank, r in enumerate(results):
        # tp innermost, dp strided; ep groups DeepSpeed's blocks of ep consecutive ranks (at ep 2 the tp groups, at
        # ep 4 across both), each expert replicated over the strided rest
        first = rank - rank % ep
        assert r["groups"] == ((rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2),
                               tuple(range(first, first + ep)), tuple(range(rank % ep, 4, ep)))
        assert r["local"] == 4 // ep and r["q_proj"] == "Shard(dim=0)"
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
