"""ZeRO-3 leaf modules: DeepSpeed's functions answer as DeepSpeed's do (checked against DeepSpeed 0.19.8 on the
CPU), a leaf merges the units inside it, and a mixture of experts whose ranks run different experts trains
as one process does once its block is a leaf."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsfunc
import dsfunc as deepspeed
from dsfunc.deepspeed.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from dsfunc.deepspeed.zero_config import DeepSpeedZeroConfig
from dsfunc.distributed import comm
from dsfunc.zero import make_plan
from tests.models import config
from tests.multiprocess import run_world


class Base(nn.Module):
    pass


class Sub(Base):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.inner = nn.Linear(2, 2), nn.Linear(2, 2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Sub(), Sub()])
        self.out = nn.Linear(2, 2)


def names(model: nn.Module, modules: list[nn.Module]) -> list[str]:
    path = {id(m): n for n, m in model.named_modules()}
    return [path[id(m)] for m in modules]


def test_the_leaf_functions_answer_as_deepspeeds():
    net = Net()
    assert names(net, set_z3_leaf_modules(net, [Base])) == ["blocks.0", "blocks.1"]  # subclasses of a class
    assert z3_leaf_module(net.blocks[0]) and not z3_leaf_module(net) and net.blocks[0]._z3_leaf is True
    assert set_z3_leaf_modules(Net(), ["Base"], raise_if_not_found=False) == []  # a name is the class's own
    assert names(net, set_z3_leaf_modules(net, [nn.Linear, f"{Sub.__module__}.Sub"])) == [
        "blocks.0.a", "blocks.0.inner", "blocks.0", "blocks.1.a", "blocks.1.inner", "blocks.1", "out"]
    assert len(get_z3_leaf_modules(net)) == 7
    assert names(net, unset_z3_leaf_modules(net, ["Linear"])) == [
        "blocks.0.a", "blocks.0.inner", "blocks.1.a", "blocks.1.inner", "out"]
    assert names(net, get_z3_leaf_modules(net)) == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match=r"no modules of the classes \[<class 'torch.nn.modules.conv.Conv2d'>\]"):
        set_z3_leaf_modules(net, [nn.Conv2d])
    with pytest.raises(TypeError, match="a list of module classes or class names"):
        set_z3_leaf_modules(net, [3])
    net = Net()
    found, missing = set_z3_leaf_modules_by_suffix(net, ["0.inner", "blocks", "nner"], raise_if_not_found=False)
    assert names(net, found) == ["blocks.0.inner", "blocks"] and missing == ["nner"]  # whole components
    found, missing = set_z3_leaf_modules_by_name(net, ["blocks.1", "", "nope"], flag=False, raise_if_not_found=False)
    assert names(net, found) == ["blocks.1", ""] and missing == ["nope"] and net._z3_leaf is False
    with pytest.raises(ValueError, match=r"no modules named \['nope'\]"):
        set_z3_leaf_modules_by_name(net, ["nope"])
    set_z3_leaf_module(net.out, True)
    assert z3_leaf_module(net.out) and not z3_leaf_parameter(net.out.weight)  # marked when ZeRO-3 trains it
    assert dsfunc.utils.set_z3_leaf_modules is set_z3_leaf_modules  # deepspeed.utils.set_z3_leaf_modules


def units(model: nn.Module, stage: int = 3) -> list[str | None]:
    return [u.module for u in make_plan(model, stage=stage, group=comm.Group.lone()).units]


def test_a_leaf_merges_the_units_inside_it():
    net = Net()
    assert units(net) == [None, "blocks.0", "blocks.1"]
    set_z3_leaf_modules(net, [nn.Linear])  # leaves inside units: nothing to merge
    assert units(net) == [None, "blocks.0", "blocks.1"]
    set_z3_leaf_module(net.blocks, True)  # a ModuleList has no forward to gather at: the root takes it
    assert units(net) == [None] and units(net, stage=2) == [None]
    wrapped = nn.Sequential(Net(), nn.Linear(2, 2))
    set_z3_leaf_modules(wrapped, [Net])
    assert units(wrapped, 3) == [None, "0"]  # one unit for the leaf, gathered at its forward


class MoE(nn.Module):
    """A mixture of experts whose routing differs between ranks: rank r runs expert r only."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.route = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[self.route](x)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(4, 4), MoE(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.out(torch.tanh(self.moe(torch.tanh(self.inp(x))))), y)


def data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(2, 4, generator=g), torch.randint(0, 2, (2,), generator=g)) for _ in range(3)]


def reference(world: int) -> dict[str, torch.Tensor]:
    """One process: each step's gradient is the mean of the ranks' losses, each through its own expert."""
    torch.manual_seed(0)
    net = Routed()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    for batches in zip(*(data(r) for r in range(world))):
        losses = []
        for r, (x, y) in enumerate(batches):
            net.moe.route = r
            losses.append(net(x, y))
        (sum(losses) / world).backward()
        for p in net.parameters():  # an expert no rank ran: a zero gradient (weight decay applies), as DeepSpeed's
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def routed(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    net = Routed()
    net.moe.route = rank
    leaves = set_z3_leaf_modules(net, [MoE])
    cfg = config(micro=2, world=world, stage=stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # the leaf's unit gathered at its forward
    engine, *_ = deepspeed.initialize(model=net, config=cfg)
    for x, y in data(rank):
        engine.backward(engine(x, y))
        engine.step()
    marked = sorted(n for n, p in net.named_parameters() if z3_leaf_parameter(p))
    with deepspeed.runtime.zero.unwrap_model_for_generation(engine) as unwrapped:
        gathered = unwrapped is engine and net.moe.experts[3].weight.shape == (4, 4)
    return {"full": dsfunc.full_params(engine.state), "leaves": len(leaves), "marked": marked,
            "gathered": gathered, "after": tuple(net.moe.experts[3].weight.shape)}


@pytest.mark.parametrize("stage", [0, 3])  # stages 0-2 reduce by unit too
def test_experts_that_differ_between_ranks_train_once_their_block_is_a_leaf(stage):
    want = reference(2)
    for r in run_world(routed, 2, stage):
        leaf_params = [f"moe.experts.{i}.{w}" for i in range(4) for w in ("bias", "weight")]
        assert r["leaves"] == 1 and r["marked"] == (leaf_params if stage == 3 else [])
        if stage == 3:
            assert r["gathered"] and r["after"] == (0,)  # gathered inside unwrap_model_for_generation only
        assert all(torch.allclose(r["full"][k], want[k], rtol=1e-6, atol=1e-7) for k in want)


def test_the_configs_leaf_module_section_marks_leaves_before_the_units_are_planned():
    net = nn.Sequential(Net(), nn.Linear(2, 2))
    cfg = config(micro=1, world=1, stage=3)
    cfg["zero_optimization"]["leaf_module"] = {"names": "0", "name_suffixes": ["inner"], "classes": []}
    state = dsfunc.init_state(net, cfg)
    assert [u.module for u in state.program.plan.units] == [None, "0"]  # the leaf's units merged into it
    assert names(net, get_z3_leaf_modules(net)) == ["0.blocks.0.inner", "0.blocks.1.inner", "0"]
    section = DeepSpeedZeroConfig(leaf_module={"classes": "my.Class"})  # deepspeed.runtime.zero.config's
    assert section.leaf_module.classes == ["my.Class"] and section.leaf_module.names == []
    assert DeepSpeedZeroConfig().leaf_module.classes[0].endswith("MixtralSparseMoeBlock")
    with pytest.raises(ValueError, match=r"leaf_module.names = 3 is invalid: expected a string or a list of strings"):
        dsfunc.init_state(Net(), {**cfg, "zero_optimization": {"stage": 3, "leaf_module": {"names": 3}}})
