"""DeepSpeed's own MoE checkpoints (real DeepSpeed 0.19.8, CPU, gloo: ``deepspeed.moe.layer.MoE`` at ep 2 on 2
ranks, its experts in ``layer_0_expert_<e>_mp_rank_00_model_states.pt``) load into dsfunc, and the step after
the load equals DeepSpeed's step after loading its own checkpoint (losses and every parameter within 1e-5). At
ZeRO 0 with AdamW (moments from the ``expp_rank_<q>`` optimizer files), ZeRO 2 with AdamW and clipping (moments from
the shards, local expert names renamed) and ZeRO 1 with SGD and momentum, weights only (``load_optimizer_states=
False`` on both sides). dsfunc loads them through the engine at ep 2 and through the functional API at ep 1 x dp 2
(each rank holding every expert: resharded); ``dsfunc export`` writes the whole model. A tiny HF Qwen3-MoE that
DeepSpeed trained without experts parallelism loads into dsfunc's AutoEP at ep 2, each rank its slice."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.experts.placement import is_expert_name, whole_expert_name
from tests.experts import hf_moe
from tests.multiprocess import run_world

pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")

SAVED, MORE, EXPERTS = 2, 1, 4
CASES = {  # DeepSpeed's ZeRO stage, its optimizer, and whether the load takes the optimizer state
    "stage0-adamw": (0, "adamw", True),
    "stage2-adamw": (2, "adamw", True),
    "stage1-sgd": (1, "sgd", False),
}


class Net(nn.Module):
    """A dense layer, then 4 experts of top-1 routing without random choices, ``moe`` DeepSpeed's or dsfunc's."""

    def __init__(self, moe: type, ep: int, experts: int = EXPERTS) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        expert = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        self.moe = moe(4, expert, num_experts=experts, ep_size=ep, min_capacity=2, use_rts=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return out.square().mean() + 0.1 * l_aux


def config(case: str) -> dict[str, Any]:
    stage, optimizer, _ = CASES[case]
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True}
    if stage:  # DeepSpeed's stage-0 clipping with experts averages the ranks' norms (tests/experts/test_engine.py)
        cfg["gradient_clipping"] = 0.05
    if optimizer == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}
    return cfg


def engine_of(backend: Any, moe: type, split: Any, case: str, ep: int = 2) -> Any:
    """An engine built as a DeepSpeed MoE script builds it (param groups split for the experts)."""
    net = Net(moe, ep)
    groups = split({"params": list(net.parameters()), "name": "dense"})
    sgd = torch.optim.SGD(groups, lr=0.1, momentum=0.9) if CASES[case][1] == "sgd" else None
    engine, *_ = backend.initialize(model=net, model_parameters=None if sgd else groups, optimizer=sgd,
                                    config=config(case))
    return engine


def batch(step: int, replica: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + replica))


def engine_steps(engine: Any, steps: range, replica: int) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(batch(step, replica))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_runs(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Per case, real DeepSpeed at ep 2: SAVED steps, save; a fresh engine loads that checkpoint and trains MORE
    steps: its losses, and this rank's parameters under their names in the whole model."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    deepspeed.init_distributed(dist_backend="gloo")
    found = {}
    for case, (_, _, optimizer_states) in CASES.items():
        torch.manual_seed(rank)  # each rank's experts start apart
        engine = engine_of(deepspeed, MoE, split, case)
        engine_steps(engine, range(SAVED), rank)
        engine.save_checkpoint(f"{folder}/{case}")
        torch.manual_seed(10 + rank)
        engine = engine_of(deepspeed, MoE, split, case)
        engine.load_checkpoint(f"{folder}/{case}", load_optimizer_states=optimizer_states)
        losses = engine_steps(engine, range(SAVED, SAVED + MORE), rank)
        params = {whole_expert_name(k, rank, EXPERTS // 2) if is_expert_name(k) else k: v.detach().clone()
                  for k, v in engine.module.state_dict().items()}
        found[case] = {"losses": losses, "params": params}
    _save_hf_moe(deepspeed, rank, f"{folder}/hf")
    return found


HF_CONFIG = {"train_micro_batch_size_per_gpu": hf_moe.MICRO, "zero_optimization": {"stage": 1},
             "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}


def _save_hf_moe(deepspeed: Any, rank: int, folder: str) -> None:
    """A tiny HF Qwen3-MoE trained one step by DeepSpeed without AutoEP (plain data parallelism, ZeRO 1), saved:
    its stacked experts (``experts.gate_up_proj`` ``[E, ...]``) whole in the shards."""
    model = hf_moe.build("qwen3_moe")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=HF_CONFIG)
    ids = hf_moe.batch(0, 2 * hf_moe.MICRO).split(hf_moe.MICRO)[rank]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """DeepSpeed's checkpoints, and per case its resumed losses (per rank) and whole model."""
    folder = tmp_path_factory.mktemp("ds_moe")
    runs = run_world(deepspeed_runs, 2, str(folder), timeout=900)
    return folder, {case: {"losses": [r[case]["losses"] for r in runs],
                           "params": {**runs[0][case]["params"], **runs[1][case]["params"]}} for case in CASES}


def dsfunc_resumes(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Per case, dsfunc loads DeepSpeed's checkpoint and trains MORE steps on the saving ranks' batches: through
    the engine at ep 2, and through the functional API at ep 1 x dp 2."""
    from dsfunc.moe.layer import MoE  # what `import dsfunc as deepspeed` gives a DeepSpeed script
    from dsfunc.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    found = {}
    for case, (_, _, optimizer_states) in CASES.items():
        engine = engine_of(dsfunc, MoE, split, case)
        engine.load_checkpoint(f"{folder}/{case}", load_optimizer_states=optimizer_states)
        losses = engine_steps(engine, range(SAVED, SAVED + MORE), rank)
        found[f"{case} ep2"] = {"losses": losses, "params": dsfunc.full_params(engine.state)}
        cfg = config(case)
        if CASES[case][1] == "sgd":
            cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
        state, _ = dsfunc.load_checkpoint(f"{folder}/{case}", dsfunc.init_state(Net(MoE, 1), cfg),
                                          load_optimizer_states=optimizer_states, load_lr_scheduler_states=True)
        losses = []
        for step in range(SAVED, SAVED + MORE):
            state = dsfunc.train_step(state, batch(step, rank))
            losses.append(float(state.metrics.loss))
        found[f"{case} ep1"] = {"losses": losses, "params": dsfunc.full_params(state)}
    autoep = {**HF_CONFIG, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    state, _ = dsfunc.load_checkpoint(f"{folder}/hf", dsfunc.init_state(hf_moe.build("qwen3_moe"), autoep))
    found["hf"] = dsfunc.full_params(state)
    return found


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_deepspeed_moe_checkpoint_resumes_like_deepspeed(saved):
    folder, want = saved
    assert sorted(p.name for p in (folder / "stage0-adamw" / f"global_step{SAVED}").iterdir()) == [
        "expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt",
        *[f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(EXPERTS)], "mp_rank_00_model_states.pt"]
    runs = run_world(dsfunc_resumes, 2, str(folder), timeout=900)
    whole = torch.load(dsfunc.export_fp32(folder / "hf", folder / "hf.pt"))
    for found in runs:  # AutoEP at ep 2: each rank read its slice of DeepSpeed's whole stacked experts
        assert all(torch.equal(found["hf"][k], v) for k, v in whole.items()) and found["hf"].keys() == whole.keys()
    for case in CASES:
        theirs = want[case]
        mean = torch.tensor(theirs["losses"]).mean(0)  # the functional API's loss is the global batch's
        for rank, found in enumerate(runs):
            for run, got in found.items():
                if not run.startswith(f"{case} "):
                    continue
                losses = torch.tensor(got["losses"])
                expected = torch.tensor(theirs["losses"][rank]) if run.endswith("ep2") else mean
                assert relative(losses, expected) < 1e-5, (run, rank, got["losses"], theirs["losses"])
                assert got["params"].keys() == theirs["params"].keys(), run
                for name, value in theirs["params"].items():
                    assert relative(got["params"][name], value) < 1e-5, (run, rank, name)


def test_dsfunc_export_writes_the_whole_model(saved, tmp_path):
    """``dsfunc export`` of DeepSpeed's MoE checkpoint: every expert of every rank and the dense weights, in the
    module's order, as DeepSpeed's files hold them; a model with all experts on one rank loads it."""
    from dsfunc.experts import MoE

    folder, _ = saved
    for case in ("stage0-adamw", "stage2-adamw"):
        files = {}
        for path in (folder / case / f"global_step{SAVED}").glob("*model_states.pt"):
            content = torch.load(path, weights_only=False)
            files.update(content.get("module", content))
        exported = torch.load(dsfunc.export_fp32(folder / case, tmp_path / f"{case}.pt"))
        assert list(exported) == list(Net(MoE, 1).state_dict()), case
        assert exported.keys() == files.keys() and all(torch.equal(exported[k], v) for k, v in files.items()), case
        Net(MoE, 1).load_state_dict(exported)


def test_a_model_with_other_experts_is_refused_naming_them(saved):
    from dsfunc.experts import MoE

    folder, _ = saved
    template = dsfunc.init_state(Net(MoE, 1, experts=2), config("stage2-adamw"))
    with pytest.raises(dsfunc.CheckpointMismatchError, match=r"does not match this model(.|\n)*deepspeed_experts\.3"):
        dsfunc.load_checkpoint(folder / "stage2-adamw", template)
    assert not template.donated  # refused before anything was read into it
