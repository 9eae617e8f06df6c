"""``deepspeed.zero.GatheredParameters(params, modifier_rank=r)`` on a MoE model at ZeRO 3 (ep 2 on 4 gloo ranks), as
DeepSpeed 0.19.8 does it (``partition_parameters.py``: ``r`` is a rank of each parameter's own partition group, the
broadcast runs within it): a non-expert parameter takes world rank r's write, an expert the write of rank r of its
expert-data-parallel group, so each ep position keeps its own experts; an r outside that group is refused."""

from __future__ import annotations

import re

import torch

import dsfunc
from dsfunc.errors import InputError
from tests.multiprocess import run_world

CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
          "zero_optimization": {"stage": 3}}


def _written(rank: int, world: int) -> dict:
    """Every rank writes ``rank + 10 * i`` into the i-th parameter under modifier_rank 1; what each rank then holds,
    and what a modifier_rank of 2 (outside the expert-data-parallel groups of 2 ranks) says."""
    from tests.experts.test_moe import Net

    torch.manual_seed(rank)
    engine, *_ = dsfunc.initialize(model=Net(2), config=CONFIG)
    params = dict(engine.module.named_parameters())
    with dsfunc.zero.GatheredParameters(list(params.values()), modifier_rank=1), torch.no_grad():
        for i, p in enumerate(params.values()):
            p.fill_(rank + 10 * i)
    with dsfunc.zero.GatheredParameters(list(params.values())):  # the compute copies, rebuilt from the masters
        shown = {name: p.detach().clone() for name, p in params.items()}
    masters = dsfunc.full_params(engine.state)
    experts = [p for name, p in params.items() if "experts" in name]
    try:
        with dsfunc.zero.GatheredParameters(experts, modifier_rank=2), torch.no_grad():
            for p in experts:
                p.zero_()
        error = ""
    except InputError as e:
        error = str(e)
    with dsfunc.zero.GatheredParameters(experts):
        kept = all(torch.equal(p, shown[name]) for name, p in params.items() if "experts" in name)
    engine.backward(engine(torch.randn(4, 4)))  # it trains on
    engine.step()
    return {"names": list(params), "shown": shown, "masters": masters, "error": error, "kept": kept}


def test_modifier_rank_writes_experts_within_their_expert_data_parallel_group():
    got = run_world(_written, 4, timeout=600)
    for rank, out in enumerate(got):
        # ep 2: experts 0-1 on ranks 0 and 2, experts 2-3 on ranks 1 and 3; their groups' rank 1: ranks 2 and 3
        modifier = {0: 2, 2: 2, 1: 3, 3: 3}[rank]
        experts = [n for n in out["names"] if "experts" in n]
        assert experts and len(experts) < len(out["names"])
        for i, name in enumerate(out["names"]):
            want = (modifier if name in experts else 1) + 10 * i
            assert (out["shown"][name] == want).all(), (rank, name, out["shown"][name])
            if name not in experts:
                assert (out["masters"][name] == want).all(), (rank, name)
                continue
            prefix, local, rest = re.match(r"(.*\.deepspeed_experts\.)(\d+)(\..*)", name).groups()
            for ep_rank in (0, 1):  # full_params: the whole model, ep rank q's experts 2q and 2q+1 from rank 2 + q
                whole = f"{prefix}{2 * ep_rank + int(local)}{rest}"
                assert (out["masters"][whole] == 2 + ep_rank + 10 * i).all(), (rank, whole)
        assert "modifier_rank=2" in out["error"] and "expert-data-parallel" in out["error"], out["error"]
        assert out["kept"]
