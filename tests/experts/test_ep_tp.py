"""AutoEP composed with AutoTP: a tiny Hugging Face Mixtral and Qwen3-MoE on 4 gloo ranks at
``tensor_parallel.autotp_size`` 2 (attention split over tp, Qwen3's per-head norms' gradients all-reduced over it,
dp 2) with their experts split over DeepSpeed's ep groups (blocks of ``autoep_size`` consecutive ranks): at ep 2
(the tp groups, each expert replicated over its dp ranks) at ZeRO 1 and 2, and at ep 4 (across both tp groups) at
ZeRO 3, train like the unmodified model in one process on the same global batches (3 steps clipped below the
gradients' norm, so an expert counted twice or missed would change every step; SGD with momentum and AdamW):
losses within 1e-5, every parameter within 1e-4. A checkpoint of tp 2 x ep 2 x dp 2 (experts whole over tp, each
ep rank's slice saved under the whole model's names) loads at tp 1 x ep 2 x dp 4 and in one process and steps on as
the uninterrupted run, and exports as the whole HF model; ``dsfunc.initialize`` at tp 2 x ep 2 trains as one
process. DeepSpeed's MoE layer under tp, any MoE under sequence parallelism and a tp plan that splits AutoEP's experts
are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

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


class _SplitColumns(ParallelStyle):
    """A user's tp style that splits every parameter of a module on dim 1 (here AutoEP's stacked experts)."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, device_mesh, [Shard(1)])))
        return module


def _refusals(rank: int, world: int) -> list[str]:
    """What init_state says on 2 ranks to DeepSpeed's MoE layer at tp 2, to AutoEP at sp 2, and to a tp plan
    that splits AutoEP's experts."""
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2))
    tp_ep = {"tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    cases = [(layer, {"tensor_parallel": {"autotp_size": 2}}, None),
             (hf_moe.build("mixtral"), {"sequence_parallel_size": 2, "expert_parallel": {"enabled": True}}, None),
             (hf_moe.build("qwen3_moe"), tp_ep, {"model.layers.*.mlp.experts": _SplitColumns()})]
    out = []
    for model, sections, plan in cases:
        try:
            dsfunc.init_state(model, hf_moe.config(1, "sgd", **sections), loss_fn=lambda m, b: m(b).sum(),
                              tp_plan=plan)
        except dsfunc.NotSupportedError as e:
            out.append(str(e))
    torch.distributed.barrier()  # no rank leaves while another still builds the mesh's groups
    return out


def test_moe_layer_under_tp_and_moe_under_sp_are_refused_by_name():
    for layer, sp, split in run_world(_refusals, 2, timeout=600):
        assert "deepspeed.moe.layer.MoE with tensor_parallel.autotp_size 2 is not supported" in layer, layer
        assert "What composes with tp is AutoEP" in layer, layer
        assert "mixture-of-experts layers with sequence_parallel_size 2 are not supported" in sp, sp
        assert "load-balancing loss" in sp, sp
        assert "the tp plan splits model.layers.0.mlp.experts.down_proj, model.layers.0.mlp.experts.gate_up_proj" \
            in split, split
        assert "leave the MoE blocks' gate and experts out of the tp plan" in split, split


def _micro1(sections: dict, optimizer: str = "adamw") -> dict:
    """Qwen3-MoE's config of 4 samples a step in micro-batches of one (gradient accumulation where dp < 4), so every
    shape's loss is the same mean of the same samples' losses."""
    return hf_moe.config(REPLICAS, optimizer, train_micro_batch_size_per_gpu=1, **sections)


def _sample(step: int, rank: int, ranks: int) -> dict:
    ids = hf_moe.batch(step, 4).split(4 // ranks)[rank]
    return {"input_ids": ids, "labels": ids}


def _save_resume_engine(rank: int, world: int, folder: str) -> dict:
    """tp 2 x ep 2 x dp 2 (AdamW, ZeRO 1): 2 steps, save, 1 more (the uninterrupted run); that checkpoint loaded at
    tp 1 x ep 2 x dp 4 (ZeRO 2) and stepped once; an engine of ``dsfunc.initialize`` at tp 2 x ep 2 for 3 steps."""
    tp_ep = {"expert_parallel": {"enabled": True, "autoep_size": 2}, "tensor_parallel": {"autotp_size": 2}}
    state = dsfunc.init_state(hf_moe.build("qwen3_moe"), _micro1({**tp_ep, "zero_optimization": {"stage": 1}}))
    dp = state.program.mesh.group("dp").rank
    split = sorted(state.program.tensor.split)
    for step in range(2):
        state = dsfunc.train_step(state, _sample(step, dp, 2))
    dsfunc.save_checkpoint(state, folder)
    saved = dsfunc.full_params(state)
    state = dsfunc.train_step(state, _sample(2, dp, 2))
    out = {"split": split, "saved": saved, "loss": float(state.metrics.loss), "params": dsfunc.full_params(state)}
    ep2 = {"expert_parallel": {"enabled": True, "autoep_size": 2}, "zero_optimization": {"stage": 2}}
    resumed, _ = dsfunc.load_checkpoint(folder, dsfunc.init_state(hf_moe.build("qwen3_moe"), _micro1(ep2)))
    resumed = dsfunc.train_step(resumed, _sample(2, rank, 4))
    out["resumed"] = (float(resumed.metrics.loss), dsfunc.full_params(resumed))
    model = hf_moe.build("qwen3_moe")
    # DeepSpeed resolves the batch under AutoTP over every rank: train_batch_size counts the tp ranks too
    engine, *_ = dsfunc.initialize(model=model, model_parameters=model.parameters(),
                                   config=hf_moe.config(world, "sgd", **tp_ep, zero_optimization={"stage": 2}))
    losses = []
    for step in range(STEPS):
        ids = hf_moe.batch(step, hf_moe.MICRO * REPLICAS).split(hf_moe.MICRO)[engine.state.program.mesh.group("dp").rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out["engine"] = (losses, dsfunc.full_params(engine.state))
    # DeepSeek's block (its shared expert split over tp by a plan of the user's) shares its tokens out over tp too
    shared = {f"model.layers.*.mlp.shared_experts.{name}": style
              for name, style in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))}
    state = dsfunc.init_state(hf_moe.build("deepseek_v2"), hf_moe.config(REPLICAS, "sgd", **tp_ep), tp_plan=shared)
    losses = []
    for step in range(STEPS):
        state = dsfunc.train_step(state, _sample(step, state.program.mesh.group("dp").rank, 2))
        losses.append(float(state.metrics.loss))
    out["deepseek"] = (losses, dsfunc.full_params(state))
    return out


def test_tp2_ep2_checkpoint_loads_at_other_shapes_and_the_engine_trains_alike(tmp_path):
    results = run_world(_save_resume_engine, 4, str(tmp_path / "ckpt"), timeout=900)
    want = results[0]
    # AutoTP splits attention only: each rank's experts (and routers) are its ep slice, whole over tp
    assert want["split"] and not [n for n in want["split"] if ".mlp." in n], want["split"]
    for r in results:
        assert abs(r["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"])
        assert abs(r["resumed"][0] - want["loss"]) <= 1e-5 * abs(want["loss"]), (r["resumed"][0], want["loss"])
        assert r["resumed"][1].keys() == want["params"].keys()
        for name, value in want["params"].items():
            assert hf_moe.relative(r["resumed"][1][name], value) <= 1e-5, name
    assert max(hf_moe.relative(want["params"][k], v) for k, v in want["saved"].items()) > 1e-3  # the step moved them
    # one process, the plain HF model (no tp, no ep, its own units): the whole model as saved, then the same step
    state = dsfunc.init_state(hf_moe.build("qwen3_moe"), _micro1({}))
    state, _ = dsfunc.load_checkpoint(tmp_path / "ckpt", state)
    loaded = dsfunc.full_params(state)
    assert loaded.keys() == want["saved"].keys()
    assert all(torch.equal(loaded[k], v) for k, v in want["saved"].items())
    state = dsfunc.train_step(state, _sample(2, 0, 1))
    assert abs(float(state.metrics.loss) - want["loss"]) <= 1e-5 * abs(want["loss"])
    full = dsfunc.full_params(state)
    assert all(hf_moe.relative(full[k], v) <= 1e-5 for k, v in want["params"].items())
    # dsfunc export of the tp x ep checkpoint: the whole HF model
    exported = torch.load(dsfunc.export_fp32(tmp_path / "ckpt", tmp_path / "whole.pt"))
    assert list(exported) == list(want["saved"]) and all(torch.equal(exported[k], v) for k, v in want["saved"].items())
    hf_moe.build("qwen3_moe").load_state_dict(exported)
    # the engine (dsfunc.initialize) at tp 2 x ep 2: the one-process run's losses and parameters
    losses, params = hf_moe.reference("qwen3_moe", REPLICAS, "sgd", STEPS)
    for tp_rank in range(2):
        mean = [(a + b) / 2 for a, b in zip(results[tp_rank]["engine"][0], results[tp_rank + 2]["engine"][0])]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mean, losses)), (mean, losses)
    for r in results:
        for name, value in params.items():
            assert hf_moe.relative(r["engine"][1][name], value) <= 1e-4, name
    losses, params = hf_moe.reference("deepseek_v2", REPLICAS, "sgd", STEPS)
    for r in results:
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["deepseek"][0], losses)), (r["deepseek"][0], losses)
        for name, value in params.items():
            assert hf_moe.relative(r["deepseek"][1][name], value) <= 1e-4, name
