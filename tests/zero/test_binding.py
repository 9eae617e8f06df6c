"""Resident parameters: a module trained in place holds the live weights between steps, without a copy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

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


class _Rotary(nn.Module):
    """HF's rotary embedding in small: no parameters, a computed fp32 ``inv_freq`` its forward reads in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(100_000, 100_000 + x.shape[1], dtype=torch.float32)
        return torch.cos(positions[:, None] * self.inv_freq.float()).repeat(1, 2).to(x.dtype)


_SEEN: dict[str, torch.dtype] = {}  # the buffers' dtypes the last forward read (dsfunc runs a copy of the module)


class _RotaryBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary, self.proj, self.bn = _Rotary(), nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _SEEN.update(inv_freq=self.rotary.inv_freq.dtype, running_mean=self.bn.running_mean.dtype)
        h = self.bn(self.proj(x) * self.rotary(x[:, :, None])[:, 0])
        return ((h.float() - y) ** 2).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameterless_modules_fp32_buffer_keeps_its_precision_under_bf16(stage):
    """As DeepSpeed 0.19.8 keeps fp32 buffers: a rotary table at position 100,000 from a bf16 ``inv_freq`` is off by
    whole radians. BatchNorm's statistics, beside their module's bf16 weight, are bound in bf16 as the weight is."""
    torch.manual_seed(0)
    model = _RotaryBN()
    cfg = {**config(micro=4, stage=stage), "bf16": {"enabled": True}}
    state = dsfunc.init_state(model, cfg)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    state = dsfunc.train_step(state, (x, y))
    assert _SEEN == {"inv_freq": torch.float32, "running_mean": torch.bfloat16}
    assert state.buffers["rotary.inv_freq"].dtype == torch.float32
    want = _Rotary()(x[:, :, None].bfloat16())
    with torch.no_grad():
        got = zero_runtime(state).evaluate(lambda m, b: m.rotary(b), x[:, :, None].bfloat16())
    assert torch.equal(got, want)
