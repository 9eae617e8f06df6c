"""The MoE layer's checks and plumbing: DeepSpeed's expert groups of ranks, the errors for configurations
DeepSpeed rejects or dsfunc does not train yet, the optimizer-group helpers, and experts as units of their own
reduced and sharded over their expert-data-parallel ranks (gloo, 2 ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.deepspeed.moe import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from dsfunc.errors import InputError, UsageError
from dsfunc.experts import MoE
from dsfunc.experts.groups import group_ranks
from dsfunc.zero.gather import owner
from tests.multiprocess import run_world


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))


def test_groups_follow_deepspeeds_arrangement():
    assert group_ranks(8, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert group_ranks(8, 2, data_first=True) == ([[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert group_ranks(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(InputError, match="expert-parallel size 4 does not divide the world size 6"):
        group_ranks(6, 4)


@pytest.mark.parametrize(("options", "message"), [
    ({"num_experts": 3, "ep_size": 2}, "num_experts=3 is not divisible by ep_size=2"),
    ({"num_experts": 4, "k": 0}, "k=0: each token goes to k of the 4 experts"),
    ({"num_experts": 4, "k": 5}, "k must be an integer from 1 to 4"),
    ({"num_experts": 4, "noisy_gate_policy": "Gumbel"}, "noisy_gate_policy='Gumbel' is not one of DeepSpeed's"),
    ({"num_experts": 4, "min_capacity": -1}, "min_capacity must be at least 0"),
])
def test_gate_configs_deepspeed_rejects_are_clear_errors(options, message):
    with pytest.raises(InputError, match=message):
        MoE(4, expert(), **options)


def test_forward_errors_name_the_fix():
    with pytest.raises(UsageError, match="no expert-parallel group yet"):
        MoE(4, expert(), num_experts=4, ep_size=2)(torch.randn(3, 4))
    with pytest.raises(InputError, match="got 3 tokens, fewer than min_capacity=4"):
        MoE(4, expert(), num_experts=2)(torch.randn(3, 4))
    with pytest.raises(InputError, match="used_token masks tokens for top-1 gating only"):
        MoE(4, expert(), num_experts=2, k=2, min_capacity=0)(torch.randn(3, 4), torch.ones(3))


def test_every_expert_runs_and_gets_a_gradient_when_no_token_goes_to_it():
    torch.manual_seed(0)
    layer = MoE(4, expert(), num_experts=4, k=1, min_capacity=1)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.zero_()[2].fill_(1.0)  # every positive token to expert 2
    out, l_aux, counts = layer(torch.rand(5, 4))
    (out.sum() + l_aux).backward()
    assert counts.tolist() == [0, 0, 5, 0]
    grads = [m[0].weight.grad for m in layer.deepspeed_moe.experts.deepspeed_experts]
    assert all(g is not None for g in grads) and grads[0].abs().sum() == 0 and grads[2].abs().sum() > 0


def test_param_group_helpers_split_experts_as_deepspeed():
    net = nn.Sequential(nn.Linear(4, 4), MoE(4, expert(), num_experts=2))
    assert has_moe_layers(net) == (True, 2) and has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    experts = list(net[1].deepspeed_moe.experts.parameters())
    assert all(is_moe_param(p) and p.group_name == "ep_size_1" for p in experts)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(net.parameters()), "name": "dense", "weight_decay": 0.1}], max_group_size=30)
    assert [g["name"] for g in groups] == ["dense", *["ep_size_1"] * 4]
    assert all(g["moe"] and g["weight_decay"] == 0.1 for g in groups[1:])
    assert [len(g["params"]) for g in groups[1:]] == [2, 2, 2, 2]  # runs of at most 30 elements: 24+6, 24+4, ...
    assert sum(len(g["params"]) for g in groups) == len(list(net.parameters()))
    assert [g["name"] for g in configure_moe_param_groups(list(net.parameters()))] == ["dense-params", "ep_size_1"]
    real = pytest.importorskip("deepspeed.moe.utils", reason="real DeepSpeed is the reference")
    theirs = real.split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(net.parameters()), "name": "dense", "weight_decay": 0.1}], max_group_size=30)
    assert [{**g, "params": [id(p) for p in g["params"]]} for g in theirs] == [
        {**g, "params": [id(p) for p in g["params"]]} for g in groups]
    with pytest.raises(InputError, match="have no 'name'"):
        split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters())})


class Net(nn.Module):
    def __init__(self, ep: int) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.moe = MoE(4, expert(), num_experts=4, ep_size=ep, min_capacity=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return out.square().mean() + l_aux


def _world(rank: int, world: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    found = {}
    with pytest.raises(InputError, match="expert-parallel size 4 does not divide the world size 2"):
        dsfunc.init_state(Net(4), config)
    torch.manual_seed(rank)
    sharded = dsfunc.init_state(Net(2), {**config, "zero_optimization": {"stage": 2}})
    found["shards"] = {u.name: (u.numel, sharded.params[u.name].numel()) for u in sharded.program.plan.units}
    state = dsfunc.init_state(Net(2), config)
    plan = state.program.plan
    found["units"] = {u.name: u.group is not None for u in plan.units}
    state = dsfunc.train_step(state, torch.randn(4, 4))
    dsfunc.initialize(model=Net(2), config=config)
    net = Net(2)  # ZeRO-3's local helpers: an expert's partition is over its own ranks (one here)
    dsfunc.initialize(model=net, config={**config, "zero_optimization": {"stage": 3}})
    weight = net.moe.deepspeed_moe.experts.deepspeed_experts[0][0].weight
    piece = dsfunc.utils.safe_get_local_fp32_param(weight)
    dsfunc.utils.safe_set_local_fp32_param(weight, piece * 2)
    found["piece"] = (piece.numel(), torch.equal(dsfunc.utils.safe_get_full_fp32_param(weight), 2 * piece.view(6, 4)))
    workspace, unit = owner(weight)  # the experts' group is one rank, the plan's two: the shard is the full flat
    found["whole"] = workspace.full_flat(unit, workspace.master[unit.name]) is workspace.master[unit.name]
    groups = dsfunc.utils.groups
    found["ranks"] = (groups._get_expert_parallel_group_ranks("ep_size_2"),
                      groups._get_expert_data_parallel_group_ranks("ep_size_2"),
                      groups._get_expert_parallel_world_size("ep_size_2"), groups._get_expert_parallel_rank("ep_size_2"),
                      groups._get_expert_data_parallel_world_size("ep_size_2"),
                      groups._get_expert_broadcast_src_rank("ep_size_2"), groups._get_max_expert_size())
    return found


def test_experts_are_units_of_their_own_and_groups_answer_as_deepspeeds():
    results = run_world(_world, 2)
    assert results[0]["units"] == {"root": False, "moe.deepspeed_moe.experts": True}
    (root, root_shard), (experts, experts_shard) = results[0]["shards"].values()  # ZeRO 2
    assert root_shard == -(-root // 2) and experts_shard == experts  # ep 2 of 2 ranks: each expert on one rank
    assert results[0]["ranks"] == ([0, 1], [0], 2, 0, 1, 0, 2)
    assert results[0]["piece"] == results[1]["piece"] == (24, True)
    assert results[0]["whole"] and results[1]["whole"]
    assert results[1]["ranks"] == ([0, 1], [1], 2, 1, 1, 1, 2)
