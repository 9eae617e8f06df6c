"""Checkpoints across real gloo processes: exact resume, and resharding over world sizes, ZeRO stages and
precisions (with an empty shard)."""

from __future__ import annotations

from pathlib import Path

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.distributed import comm
from tests.checkpoint.common import FP16, WARMUP
from tests.checkpoint.ranks import run_ranks
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

GLOBAL_BATCH = 8


def step_batch(batches: list, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of optimizer step ``step`` (a function of the step)."""
    x, y = batches[step]
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train_to(state: dsfunc.TrainState, steps: int, batches: list, rank: int, world: int) -> dsfunc.TrainState:
    while int(state.step) < steps:
        state = dsfunc.train_step(state, step_batch(batches, int(state.step), rank, world))
    return state


# --------------------------------------------------------------------------------------------------
# exact resume: N steps, save, load in a fresh process group, M steps == N + M steps, bitwise

N, M = 4, 4


def resume_config(stage: int, world: int) -> dict:
    cfg = config(micro=GLOBAL_BATCH // world, world=world, stage=stage, fp16=FP16, scheduler=WARMUP)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # stage 3 gathers every block lazily
    return cfg


def uninterrupted_with_saves(rank: int, world: int, root: str) -> dict:
    batches = mlp_batches(N + M, GLOBAL_BATCH)
    out: dict = {"overflowed at": {}}
    for stage in range(4):
        torch.manual_seed(0)
        state = dsfunc.init_state(MLP(dropout=0.1), resume_config(stage, world), seed=5)
        state = train_to(state, N, batches, rank, world)
        out["overflowed at"][stage] = int(state.scaler.last_overflow_iter)
        ckpt.save_checkpoint(state, Path(root) / f"stage{stage}", client_state={"stage": stage, "rank": rank},
                             async_save=stage == 2)  # stage 2 trains on while the save is written
        state = train_to(state, N + M, batches, rank, world)
        ckpt.wait_for_checkpoint()
        out[stage] = optree.tree_leaves(state)
    return out


def resume(rank: int, world: int, root: str) -> dict[int, list[torch.Tensor]]:
    batches = mlp_batches(N + M, GLOBAL_BATCH)
    out = {}
    for stage in range(4):
        torch.manual_seed(1)  # other initial weights and dropout seed: the checkpoint must replace both
        template = dsfunc.init_state(MLP(dropout=0.1), resume_config(stage, world), seed=0)
        state, client = ckpt.load_checkpoint(Path(root) / f"stage{stage}", template)
        assert client == {"stage": stage, "rank": 0} and int(state.step) == N
        state = train_to(state, N + M, batches, rank, world)
        out[stage] = optree.tree_leaves(state)
    return out


def test_exact_resume_every_stage_in_a_fresh_process_group(tmp_path):
    reference = run_world(uninterrupted_with_saves, 2, str(tmp_path))
    resumed = run_world(resume, 2, str(tmp_path))
    for rank in range(2):
        for stage in range(4):
            ref, got = reference[rank][stage], resumed[rank][stage]
            assert len(ref) == len(got)
            same = [torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ref, got)]
            differ = [i for i, s in enumerate(same) if not s]
            assert not differ, f"rank {rank} stage {stage}: leaves {differ} differ"
    assert reference[0][0][0] == N + M  # the step
    # the fp16 scaler overflowed before the save, so its restored state (scale, hysteresis) matters
    assert all(0 <= at < N for at in reference[0]["overflowed at"].values())


# --------------------------------------------------------------------------------------------------
# resharding: world sizes 2 -> 1, 2 -> 4, 4 -> 2; stages 3 -> 2, 2 -> 0, 0 -> 3, 1 -> 3; fp16/bf16 <-> fp32

UNITS = ["body.blocks.0", "body.blocks.1", "body.blocks.2", "gate"]  # gate: 5 elements, none on rank 3 of 4
PRECISIONS = {"fp32": {}, "fp16": {"fp16": FP16}, "bf16": {"bf16": {"enabled": True}}}


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = MLP(width=8, depth=3)
        self.gate = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        return F.cross_entropy((logits * torch.sigmoid(self.gate(logits))).float(), y)


def gated_state(world: int, stage: int, precision: str, seed: int = 0,
                device: str | None = None) -> dsfunc.TrainState:
    torch.manual_seed(seed)
    cfg = config(micro=GLOBAL_BATCH // world, world=world, stage=stage, **PRECISIONS[precision])
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return dsfunc.init_state(Gated(), cfg, unit_modules=UNITS, device=device)


def full_moments(state: dsfunc.TrainState) -> dict[str, torch.Tensor]:
    """Every optimizer-state leaf shaped like a unit, gathered to its full unpadded length."""
    plan = state.program.plan
    out = {}
    accessors, leaves, _ = optree.tree_flatten_with_accessor(state.opt_state)
    for accessor, leaf in zip(accessors, leaves):
        unit = accessor[-1].entry
        if unit in state.params and leaf.shape == state.params[unit].shape:
            n = plan.unit(unit).numel
            full = torch.empty(plan.padded_size(plan.unit(unit)), device=leaf.device)
            comm.all_gather_flat(full, leaf, plan.group) if plan.ways > 1 else full.copy_(leaf)
            out[str(accessor)] = full[:n].cpu()
    return out


def snapshot(state: dsfunc.TrainState) -> dict:
    params = {k: v.cpu() for k, v in dsfunc.full_params(state).items()}
    return {"params": params, "moments": full_moments(state), "step": int(state.step)}


def assert_same(loaded: dict, saved: dict) -> None:
    assert loaded["step"] == saved["step"]
    for kind in ("params", "moments"):
        assert loaded[kind].keys() == saved[kind].keys()
        for k in saved[kind]:
            assert torch.equal(loaded[kind][k], saved[kind][k]), f"{kind} {k} differs"


SAVED_AT_2 = {"s1_fp16": (1, "fp16"), "s2_fp32": (2, "fp32"), "s3_bf16": (3, "bf16"), "s0_fp16": (0, "fp16")}


def save_at_two(rank: int, world: int, root: str) -> dict:
    batches = mlp_batches(3, GLOBAL_BATCH)
    out = {}
    for name, (stage, precision) in SAVED_AT_2.items():
        state = train_to(gated_state(world, stage, precision), 3, batches, rank, world)
        ckpt.save_checkpoint(state, Path(root) / name)
        out[name] = snapshot(state)
    return out


def load_continue(root: str, name: str, world: int, stage: int, precision: str,
                  steps: int) -> tuple[dict, dict]:
    state, _ = ckpt.load_checkpoint(Path(root) / name, gated_state(world, stage, precision, seed=9))
    loaded = snapshot(state)
    state = train_to(state, loaded["step"] + steps, mlp_batches(10, GLOBAL_BATCH, seed=1), comm.rank(), world)
    assert torch.isfinite(state.metrics.loss)
    return loaded, dsfunc.full_params(state)


def at_four(rank: int, world: int, root: str) -> dict:
    out = {"2->4 stage 2->2 fp32": load_continue(root, "s2_fp32", world, 2, "fp32", 2),
           "2->4 stage 1->3 fp16->bf16": load_continue(root, "s1_fp16", world, 3, "bf16", 1)}
    state, _ = ckpt.load_checkpoint(Path(root) / "s0_fp16", gated_state(world, 3, "fp16", seed=9))
    out["2->4 stage 0->3 fp16"] = (snapshot(state), None)
    state = train_to(state, 5, mlp_batches(10, GLOBAL_BATCH, seed=2), rank, world)
    ckpt.save_checkpoint(state, Path(root) / "w4_s3_fp16")  # gate's shard on rank 3 is empty
    out["saved"] = snapshot(state)
    return out


def at_two(rank: int, world: int, root: str) -> dict:
    return {"4->2 stage 3->2 fp16->fp32": load_continue(root, "w4_s3_fp16", world, 2, "fp32", 1),
            "2->2 stage 3->2 bf16": load_continue(root, "s3_bf16", world, 2, "bf16", 1),
            "2->2 stage 2->0 fp32": load_continue(root, "s2_fp32", world, 0, "fp32", 2)}


def test_reshard_across_world_sizes_stages_and_precisions(tmp_path):
    root = str(tmp_path)
    saved = run_world(save_at_two, 2, root)[0]

    # 2 -> 1 (one process, no process group), every stage and precision into stage-0 fp32
    continued = {}
    for name in SAVED_AT_2:
        loaded, continued[name] = load_continue(root, name, 1, 0, "fp32", 2)
        assert_same(loaded, saved[name])

    four = run_world(at_four, 4, root)
    assert_same(four[0]["2->4 stage 2->2 fp32"][0], saved["s2_fp32"])
    assert_same(four[0]["2->4 stage 1->3 fp16->bf16"][0], saved["s1_fp16"])
    assert_same(four[0]["2->4 stage 0->3 fp16"][0], saved["s0_fp16"])
    # training continues at 4 ranks as at 1 (same global batches; only the reduction order differs)
    after = four[0]["2->4 stage 2->2 fp32"][1]
    for k, v in continued["s2_fp32"].items():
        torch.testing.assert_close(after[k], v, rtol=1e-5, atol=1e-6)

    two = run_world(at_two, 2, root)
    assert_same(two[0]["4->2 stage 3->2 fp16->fp32"][0], four[0]["saved"])
    assert_same(two[0]["2->2 stage 3->2 bf16"][0], saved["s3_bf16"])
    assert_same(two[0]["2->2 stage 2->0 fp32"][0], saved["s2_fp32"])
    for k, v in continued["s2_fp32"].items():
        torch.testing.assert_close(two[0]["2->2 stage 2->0 fp32"][1][k], v, rtol=1e-5, atol=1e-6)

    # the checkpoint with an empty shard exports (offline) to exactly the saved weights
    out = tmp_path / "w4.pt"
    ckpt.export_fp32(tmp_path / "w4_s3_fp16", out)
    exported = torch.load(out)
    assert exported.keys() == four[0]["saved"]["params"].keys()
    assert all(torch.equal(exported[k], v) for k, v in four[0]["saved"]["params"].items())


# --------------------------------------------------------------------------------------------------
# CUDA: NCCL training group, checkpoint traffic on the gloo side group, DTensors on the CUDA device


def on_gpus(rank: int, world: int, root: str) -> dict:
    batches = mlp_batches(4, GLOBAL_BATCH)
    state = train_to(gated_state(world, 3, "bf16", device="cuda"), 2, batches, rank, world)
    ckpt.save_checkpoint(state, Path(root), tag="sync")
    saved = snapshot(state)
    ckpt.save_checkpoint(state, Path(root), tag="async", async_save=True)  # staged to host memory
    state = train_to(state, 4, batches, rank, world)
    ckpt.wait_for_checkpoint()
    loaded = {}
    for tag in ("sync", "async"):
        template = gated_state(world, 1, "fp32", seed=9, device="cuda")
        new, _ = ckpt.load_checkpoint(Path(root), template, tag=tag)
        assert all(t.is_cuda for t in new.params.values())
        loaded[tag] = snapshot(new)
        new = train_to(new, 4, batches, rank, world)
        assert torch.isfinite(new.metrics.loss)
    return {"saved": saved, "loaded": loaded}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_nccl_save_async_save_and_reshard(tmp_path):
    results = run_ranks(on_gpus, 2, str(tmp_path), backend="nccl", timeout=300)
    assert [code for code, _ in results] == [0, 0], results
    out = results[0][1]
    for tag in ("sync", "async"):
        assert_same(out["loaded"][tag], out["saved"])
        loaded, _ = load_continue(str(tmp_path), tag, 1, 0, "fp32", 0)  # and in one process, no group
        assert_same(loaded, out["saved"])
