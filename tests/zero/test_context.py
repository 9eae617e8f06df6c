"""zero.Init keeps each parameter's value in pieces behind an empty placeholder on the device, as DeepSpeed's;
GatheredParameters shows full ZeRO-3 parameters and commits a modifier rank's writes to every rank's masters; the
per-parameter helpers read and write one parameter of an engine's state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsfunc
import dsfunc as deepspeed
from dsfunc.deepspeed.zero_context import gathered_state_dict
from dsfunc.zero import GatheredParameters, Init, ZeroParamStatus
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

ZERO3 = {"zero_optimization": {"stage": 3}}


class Custom(nn.Module):
    """Parameters made outside any reset_parameters(): in __init__, and replaced after construction."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.extra = nn.Parameter(torch.randn(5, 2))


def built(under_init: bool) -> tuple[nn.Module, nn.Module]:
    """An MLP and a Custom made from seed 0, the Custom given more parameters by a script's own init code."""
    torch.manual_seed(0)
    with Init(config_dict_or_path=ZERO3, enabled=under_init):
        net, custom = MLP(), Custom()
        custom.lin.weight = nn.Parameter(torch.full((3, 4), 7.0))
        custom.added = nn.Parameter(torch.arange(6.0).view(2, 3))
    return net, custom


def test_zero_init_keeps_values_behind_empty_placeholders_on_the_device():
    net, custom = built(True)
    want_net, want_custom = built(False)
    ids = set()
    for (name, p), want in zip([*net.named_parameters(), *custom.named_parameters()],
                               [*want_net.parameters(), *want_custom.parameters()]):
        assert p.numel() == 0 and p.device.type == "cpu" and p.dtype == torch.float32, name  # never meta
        assert p.ds_shape == want.shape and p.ds_numel == want.numel(), name
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_tensor.numel() == want.numel(), name
        ids.add(p.ds_id)
        with GatheredParameters([p]):
            assert p.ds_status is ZeroParamStatus.AVAILABLE
            assert torch.equal(p, want), name  # the value construction (or the script) gave it
        assert p.numel() == 0
    assert len(ids) == len(list(net.parameters())) + len(list(custom.parameters()))
    assert not hasattr(want_net.inp.weight, "ds_id")
    with GatheredParameters([net.inp.weight, net.inp.bias], modifier_rank=0), torch.no_grad():
        net.inp.weight.fill_(0.5)
    engine, *_ = deepspeed.initialize(model=net, config=config(micro=2, stage=3))
    full = dsfunc.full_params(engine.state)
    assert (full["inp.weight"] == 0.5).all() and torch.equal(full["inp.bias"], want_net.inp.bias)
    assert all(torch.equal(full[k], v) for k, v in want_net.state_dict().items() if k != "inp.weight")
    assert not hasattr(net.inp.weight, "ds_tensor")  # its pieces went into the state
    engine, *_ = deepspeed.initialize(model=custom, config=config(micro=2, stage=3))
    full = dsfunc.full_params(engine.state)
    assert all(torch.equal(full[k], v) for k, v in want_custom.state_dict().items())
    _, custom = built(True)
    full = dsfunc.full_params(dsfunc.init_state(custom, config(micro=2, stage=2)))  # the functional API, a copy
    assert all(torch.equal(full[k], v) for k, v in want_custom.state_dict().items())


def test_zero_init_partitions_a_module_once_it_is_built():
    with Init(config_dict_or_path=ZERO3):
        lin = nn.Linear(3, 3)  # reset_parameters() ran on the full weight, inside Linear's __init__
        assert lin.weight.numel() == 9  # not attached to a parent yet: partitioned when the block ends
        seq = nn.Sequential(lin)
        assert lin.weight.numel() == 0 and lin.weight.ds_shape == (3, 3)
        with Init(config_dict_or_path=ZERO3):  # nested, as Hugging Face's composite models do
            inner = nn.Linear(2, 2)
    assert inner.weight.numel() == 0 and hasattr(inner.weight, "ds_id")
    late = nn.Linear(2, 2)
    seq.late = late  # outside the block: left whole, initialize takes it as it is
    assert late.weight.numel() == 4 and not hasattr(late.weight, "ds_id")
    converted = nn.Linear(2, 2)
    Init(module=converted)  # a built model, partitioned at once
    assert converted.weight.numel() == 0 and converted.weight.ds_numel == 4
    with pytest.raises(dsfunc.NotSupportedError, match="parameter offload to NVMe is not built"):
        Init(remote_device="nvme")
    with Init(remote_device="cpu"):  # where the state lives is the config's offload sections
        assert MLP().inp.weight.numel() == 0


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
    """What Hugging Face's ZeRO-3 from_pretrained does: build under zero.Init, write through rank 0. The ranks
    seed differently: rank 0's construction is the one kept."""
    torch.manual_seed(rank)
    with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        net = MLP(width=10, depth=3)
    torch.manual_seed(0)
    weights = MLP(width=10, depth=3).state_dict()  # torch's init on rank 0
    constructed = dict(net.named_parameters())
    piece = net.blocks[0][0].weight.ds_tensor.numel()  # this rank's share, until initialize
    with GatheredParameters([constructed["out.bias"]], modifier_rank=0), torch.no_grad():
        if rank == 0:
            constructed["out.bias"].copy_(torch.arange(4.0))
    engine, *_ = deepspeed.initialize(model=net, config=config(micro=2, world=world, stage=3))
    x, y = mlp_batches(1, 2 * world)[0]
    loss = engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
    return {"piece": piece, "full": dsfunc.full_params(engine.state), "loaded": weights, "loss": loss.item()}


def test_values_made_under_zero_init_are_rank_zeros_kept_sharded_until_initialize():
    results = run_world(loaded_before_initialize, 2)
    want = results[0]["loaded"]
    for r in results:
        assert r["piece"] == 50  # 1/2 of a 10x10 weight on each rank, never the model
        assert torch.equal(r["full"]["out.bias"], torch.arange(4.0))  # rank 0's write
        assert all(torch.equal(r["full"][k], want[k]) for k in want if k != "out.bias"), "rank 0's construction"
        assert r["loss"] == r["loss"]  # the module runs (gathers) on every rank
