"""Resident parameters: a module trained in place holds the live weights between steps, without a copy."""

from __future__ import annotations

import copy

import pytest
import torch

import dsfunc
from dsfunc.zero.binding import ZeroParamStatus
from dsfunc.zero.runtime import zero_runtime
from tests.models import MLP, ConvBN, config, mlp_batches, relative_diff


def trained(model, cfg, steps=3, **kwargs):
    state = dsfunc.init_state(model, cfg, in_place=True, **kwargs)
    for batch in mlp_batches(steps, cfg["train_micro_batch_size_per_gpu"]):
        state = dsfunc.train_step(state, batch)
    return state


def test_fp32_stage_0_module_parameters_are_views_of_the_masters():
    torch.manual_seed(0)
    model = MLP()
    objects = {name: p for name, p in model.named_parameters()}
    state = trained(model, config(micro=2))
    assert {name: p for name, p in model.named_parameters()} == objects  # the same parameter objects
    master = state.params["root"]
    assert model.inp.weight.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
    assert relative_diff(model.state_dict(), dsfunc.full_params(state)) == 0.0
    assert all(p.is_leaf and p.requires_grad and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_module_holds_the_compute_copy(stage):
    cfg = config(micro=2, stage=stage)
    cfg["bf16"] = {"enabled": True}
    model = MLP()
    state = trained(model, cfg)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    full = dsfunc.full_params(state)
    for name, p in model.named_parameters():
        assert torch.equal(p, full[name].to(torch.bfloat16)), name


def test_stage_3_parameters_are_empty_outside_a_forward_and_gathered_by_one():
    cfg = config(micro=2, stage=3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model = MLP()
    state = trained(model, cfg)
    block = model.blocks[0][0].weight
    assert block.numel() == 0 and block.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert block.ds_shape == torch.Size([8, 8]) and block.ds_numel == 64
    assert model.inp.weight.shape == (8, 6)  # the root unit is never lazy
    x, _ = mlp_batches(1, 2)[0]
    with torch.no_grad():
        direct = model(x)  # the module's own hooks gather each block for its forward
        engine_like = zero_runtime(state).evaluate(lambda m, b: m(b), x)
    assert torch.equal(direct, engine_like)
    assert block.numel() == 0 and state.program.run.workspace.stats.live_units == set()


def test_the_functional_api_leaves_the_module_alone():
    torch.manual_seed(0)
    model = MLP()
    before = copy.deepcopy(model.state_dict())
    state = dsfunc.init_state(model, config(micro=2))
    for batch in mlp_batches(2, 2):
        state = dsfunc.train_step(state, batch)
    assert relative_diff(model.state_dict(), before) == 0.0
    assert relative_diff(dsfunc.full_params(state), before) > 0


def test_a_meta_module_gets_real_residents_and_buffers_are_the_states():
    with torch.device("meta"):
        model = MLP()
    state = trained(model, config(micro=2))
    assert not any(p.is_meta for p in model.parameters())
    assert relative_diff(model.state_dict(), dsfunc.full_params(state)) == 0.0
    bn = ConvBN()
    x, y = torch.randn(4, 3, 5, 5), torch.randint(0, 3, (4,))
    state = dsfunc.init_state(bn, config(micro=4), in_place=True)
    state = dsfunc.train_step(state, (x, y))
    assert bn.bn.running_mean is state.buffers["bn.running_mean"] and bn.bn.running_mean.abs().sum() > 0


def test_an_in_place_module_follows_the_newest_state_when_not_donating():
    model = MLP()
    state = trained(model, config(micro=2), steps=1)
    newer = dsfunc.train_step(state, mlp_batches(1, 2, seed=5)[0], donate=False)
    assert relative_diff(model.state_dict(), dsfunc.full_params(newer)) == 0.0
    assert relative_diff(dsfunc.full_params(state), dsfunc.full_params(newer)) > 0
