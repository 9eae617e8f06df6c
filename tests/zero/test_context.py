"""zero.Init builds on meta; GatheredParameters shows full ZeRO-3 parameters and commits a modifier rank's writes
to every rank's masters; the per-parameter helpers read and write one parameter of an engine's state."""

from __future__ import annotations

import pytest
import torch

import dsfunc
import dsfunc as deepspeed
from dsfunc.zero import GatheredParameters, Init, ZeroParamStatus
from dsfunc.zero.context import gathered_state_dict
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world


def test_zero_init_builds_on_meta_and_initialize_materialises():
    with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        net = MLP()
    assert all(p.is_meta for p in net.parameters())
    with Init(enabled=False):
        assert not MLP().inp.weight.is_meta
    with GatheredParameters(net.inp.weight):  # nothing written yet: nan
        assert net.inp.weight.isnan().all()
    with GatheredParameters([net.inp.weight, net.inp.bias], modifier_rank=0), torch.no_grad():
        net.inp.weight.fill_(0.5)  # the bias is left alone: reset_parameters() gives it its value
    assert net.inp.weight.is_meta  # kept aside until initialize
    with GatheredParameters(net.inp.weight):
        assert (net.inp.weight == 0.5).all()
    engine, *_ = deepspeed.initialize(model=net, config=config(micro=2, stage=3))
    assert not any(p.is_meta for p in net.parameters())
    full = dsfunc.full_params(engine.state)
    assert (full["inp.weight"] == 0.5).all() and not full["inp.bias"].isnan().any()
    with pytest.raises(dsfunc.NotSupportedError, match="parameter offload to NVMe is not built"):
        Init(remote_device="nvme")
    with Init(remote_device="cpu"):  # where the state lives is the config's offload sections
        assert MLP().inp.weight.is_meta


def test_tensors_no_state_trains_are_left_alone():
    t = torch.nn.Parameter(torch.ones(3))
    with GatheredParameters([t], modifier_rank=0):
        t.data.fill_(2.0)
    assert t.tolist() == [2.0, 2.0, 2.0]


def gathered_on_ranks(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    net = MLP(width=10, depth=3)
    cfg = config(micro=2, world=world, stage=stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=net, config=cfg)
    for x, y in mlp_batches(2, 2 * world):
        engine.backward(engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
        engine.step()
    block = net.blocks[1][0].weight
    outside = (tuple(block.shape), getattr(block, "ds_status", None))
    with GatheredParameters(net.parameters()):
        inside = (block.detach().clone(), getattr(block, "ds_status", None))
    with GatheredParameters([block], modifier_rank=1):
        if rank == 1:
            block.data.fill_(0.25)
    full = dsfunc.full_params(engine.state)
    consolidated = gathered_state_dict(net)
    fp32 = deepspeed.utils.safe_get_full_fp32_param(net.blocks[2][0].bias)
    deepspeed.utils.safe_set_full_fp32_param(net.blocks[2][0].bias, torch.arange(10.0))
    moment = deepspeed.utils.safe_get_full_optimizer_state(net.blocks[2][0].bias, "exp_avg")
    return {"outside": outside, "inside": inside, "full": full, "consolidated": consolidated, "fp32": fp32,
            "after_set": dsfunc.full_params(engine.state)["blocks.2.0.bias"], "moment": moment}


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_and_the_per_parameter_helpers_on_two_ranks(stage):
    results = run_world(gathered_on_ranks, 2, stage)
    for rank, r in enumerate(results):
        if stage == 3:
            assert r["outside"] == ((0,), ZeroParamStatus.NOT_AVAILABLE)
            assert r["inside"][1] is ZeroParamStatus.AVAILABLE
        assert r["inside"][0].shape == (10, 10)
        assert torch.equal(r["full"]["blocks.1.0.weight"], torch.full((10, 10), 0.25))  # rank 1's write, everywhere
        assert r["after_set"].tolist() == [float(i) for i in range(10)]
        assert r["moment"].shape == (10,) and r["moment"].abs().sum() > 0
        assert torch.equal(r["fp32"], results[0]["fp32"])
    consolidated = results[0]["consolidated"]
    assert results[1]["consolidated"] is None and consolidated["blocks.1.0.weight"].shape == (10, 10)
    for name, value in consolidated.items():
        assert torch.equal(value, results[0]["full"][name]), name


def loaded_before_initialize(rank: int, world: int) -> dict:
    """What Hugging Face's ZeRO-3 from_pretrained does: build under zero.Init, write through rank 0."""
    with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        net = MLP(width=10, depth=3)
    weights = MLP(width=10, depth=3).state_dict()  # torch's init: the values rank 0 loads
    for name, p in net.named_parameters():
        with GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if rank == 0:
                p.copy_(weights[name])
    piece = net.blocks[0][0].weight.__dict__["_dsfunc_pending"].values.numel()  # this rank's share, until then
    engine, *_ = deepspeed.initialize(model=net, config=config(micro=2, world=world, stage=3))
    return {"piece": piece, "full": dsfunc.full_params(engine.state), "loaded": weights if rank == 0 else None}


def test_values_written_under_zero_init_are_kept_sharded_until_initialize():
    results = run_world(loaded_before_initialize, 2)
    want = results[0]["loaded"]
    for r in results:
        assert r["piece"] == 50  # 1/2 of a 10x10 weight on each rank, never the model
        assert all(torch.equal(r["full"][k], want[k]) for k in want)
