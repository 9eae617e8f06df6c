"""Checkpoints of MoE states: each expert saved under its place in the whole model, so a checkpoint of ep 2 on 2
ranks loads in one process (ep 1, every expert) and at ep 2 x dp 2 on 4 ranks, where training goes on as the
uninterrupted run (gloo), and exports as the whole model. AdamW with clipping and SGD with momentum, at ZeRO 0, 1
and 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import dsfunc
from dsfunc.experts import MoE
from tests.multiprocess import run_world

SAVED, MORE = 3, 3
CASES = {  # the saving run's ZeRO stage, and the 4-rank resume's
    "adamw": ({"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}, 2, 1),
    "sgd": ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, 0, 2),
}


class Net(nn.Module):
    """A dense layer, then 4 experts of top-1 routing without random choices (the runs compare exactly)."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        expert = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        self.moe = MoE(4, expert, num_experts=4, ep_size=ep, min_capacity=2, use_rts=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return out.square().mean() + 0.1 * l_aux


def config(case: str, stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 8, "optimizer": CASES[case][0], "gradient_clipping": 0.05,
            "zero_optimization": {"stage": stage}}


def batch(step: int, replica: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + replica))


def train(state: dsfunc.TrainState, steps: range, replica: int) -> tuple[dsfunc.TrainState, list[float]]:
    losses = []
    for step in steps:
        state = dsfunc.train_step(state, batch(step, replica))
        losses.append(float(state.metrics.loss))
    return state, losses


def _save_at_ep2(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Per case: 3 steps, save, 3 more (the uninterrupted run)."""
    found = {}
    for case, (_, stage, _) in CASES.items():
        torch.manual_seed(rank)  # each rank's experts start apart
        state, _ = train(dsfunc.init_state(Net(2), config(case, stage)), range(SAVED), rank)
        dsfunc.save_checkpoint(state, f"{folder}/{case}")
        saved = dsfunc.full_params(state)
        state, losses = train(state, range(SAVED, SAVED + MORE), rank)
        found[case] = {"saved": saved, "losses": losses, "params": dsfunc.full_params(state)}
    return found


def _resume_at_ep2_dp2(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Per case: load at ep 2 x dp 2, each expert-data-parallel replica trained on the saving run's batches."""
    found = {}
    for case, (_, _, stage) in CASES.items():
        state, _ = dsfunc.load_checkpoint(f"{folder}/{case}", dsfunc.init_state(Net(2), config(case, stage)))
        state, losses = train(state, range(SAVED, SAVED + MORE), rank % 2)
        found[case] = {"losses": losses, "params": dsfunc.full_params(state)}
    return found


def test_moe_checkpoint_loads_at_other_expert_parallel_degrees(tmp_path: Path):
    saved = run_world(_save_at_ep2, 2, str(tmp_path / "ep2"))
    for case, (_, stage, _) in CASES.items():
        want = saved[0][case]
        assert saved[1][case]["params"].keys() == want["params"].keys()
        assert [k for k in want["saved"] if ".deepspeed_experts." in k][::4] == [
            f"moe.deepspeed_moe.experts.deepspeed_experts.{i}.0.weight" for i in range(4)]
        assert all(torch.equal(saved[1][case]["saved"][k], v) for k, v in want["saved"].items())  # the whole model
        # one process, ep 1: every expert, as the 2 ranks held them; saved again from here for the 4 ranks
        state, _ = dsfunc.load_checkpoint(tmp_path / "ep2" / case, dsfunc.init_state(Net(1), config(case, stage)))
        loaded = dsfunc.full_params(state)
        assert loaded.keys() == want["saved"].keys()
        assert all(torch.equal(loaded[k], v) for k, v in want["saved"].items())
        dsfunc.save_checkpoint(state, tmp_path / "ep1" / case)
        # dsfunc export: the whole model, which an ep 1 model takes
        exported = torch.load(dsfunc.export_fp32(tmp_path / "ep2" / case, tmp_path / f"{case}.pt"))
        assert list(exported) == list(want["saved"]) and all(torch.equal(exported[k], v) for k, v in want["saved"].items())
        Net(1).load_state_dict(exported)
    resumed = run_world(_resume_at_ep2_dp2, 4, str(tmp_path / "ep1"))
    for case in CASES:
        want = saved[0][case]
        for rank in range(4):
            got = resumed[rank][case]
            assert got["losses"] == want["losses"] or max(
                abs(a - b) for a, b in zip(got["losses"], want["losses"])) < 1e-6, (case, rank)
            moved = max((want["params"][k] - want["saved"][k]).abs().max().item() for k in want["params"])
            assert moved > 1e-3  # the 3 more steps change the weights: equal parameters are no accident
            assert max((got["params"][k] - v).abs().max().item() for k, v in want["params"].items()) < 1e-6, case
