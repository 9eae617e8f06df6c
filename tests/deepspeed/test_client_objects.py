"""Client optimizers and lr schedulers under real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks) and under dsfunc: a custom
``torch.optim.Optimizer`` subclass, RMSprop and Adam(amsgrad) run their own ``step()`` (dsfunc on its fp32 shards),
an empty param group is dropped, ``initialize`` returns the client's objects as DeepSpeed does, the engine steps the
client's scheduler, and ``was_step_applied()`` answers as DeepSpeed's on and off the accumulation boundary; with the
config's optimizer, a callable's scheduler is returned and drives the lr, and one built on another optimizer is returned
and stepped without changing the lr."""

from __future__ import annotations

import copy

import pytest
import torch

import dsfunc
from dsfunc.deepspeed import initialize
from tests.deepspeed.test_against_deepspeed import ROOT, both_sides

SCRIPT = f"{ROOT}/tests/deepspeed/scripts/ds_client_objects.py"


def test_client_optimizer_and_scheduler_as_deepspeed(tmp_path):
    for rank, (ds, ours) in enumerate(both_sides(tmp_path, SCRIPT)):
        refused = ds.pop("untested_refused")
        assert ours.pop("untested_refused") == refused
        assert {case for case, v in refused.items() if v == "refused"} == {
            (1, "sgd", False), (2, "sgd", False), (3, "sgd", False), (1, "heavyball", False)}
        expected_cases, got_cases = ds.pop("config_optimizer"), ours.pop("config_optimizer")
        assert sorted(got_cases) == sorted(expected_cases)
        for case, expected in expected_cases.items():
            got = got_cases[case]
            for key in ("scheduler_class", "engine_scheduler", "scheduler_is_client"):
                assert got[key] == expected[key], (rank, case, key)
            for key in ("lr", "scheduler_lr"):
                flat = [lr for step in got[key] for lr in step]
                assert flat == pytest.approx([lr for step in expected[key] for lr in step], rel=1e-6), (rank, case, key)
            for name, value in expected["params"].items():
                assert (got["params"][name] - value).abs().max() / value.abs().max() < 1e-5, (rank, case, name)
        assert sorted(ours, key=str) == sorted(ds, key=str)
        for case, expected in ds.items():
            got = ours[case]
            for key in ("optimizer_is_client", "wraps_client", "scheduler_is_client", "engine_scheduler_is_client",
                        "groups", "applied", "lr"):
                assert got[key] == expected[key], (rank, case, key)
            for name, value in expected["params"].items():
                assert (got["params"][name] - value).abs().max() / value.abs().max() < 1e-6, (rank, case, name)


class HeavyBall(torch.optim.Optimizer):
    """Momentum SGD of the client's own, its state a tensor per parameter."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = p.grad.clone()
                else:
                    state["buf"].mul_(0.8).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_client_optimizers_own_step_resumes_exactly(stage, tmp_path):
    """Its state lives in the engine's state: saved, loaded, and the run goes on bit for bit."""
    def engine():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True}
        return initialize(model=net, optimizer=HeavyBall(net.parameters()), config=config)[0]

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(6)]

    def run(e, batches):
        for x, y in batches:
            e.backward(((e(x) - y) ** 2).mean())
            e.step()

    whole = engine()
    run(whole, data)
    first = engine()
    run(first, data[:3])
    first.save_checkpoint(tmp_path)
    resumed = engine()
    resumed.load_checkpoint(tmp_path)
    run(resumed, data[3:])
    expected, got = dsfunc.full_params(whole.state), dsfunc.full_params(resumed.state)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert not torch.equal(expected["0.weight"], dsfunc.full_params(first.state)["0.weight"])


def steps_beside(engine, reference: torch.nn.Module, opt: torch.optim.Optimizer, sched, steps: int):
    """``steps`` steps of ``engine`` beside the same steps of ``reference`` under torch's ``opt`` and ``sched`` (a
    squared error on seeded batches), yielding after each for the caller's checks."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()
        yield step


def test_a_client_scheduler_without_closed_form_drives_the_lr():
    """OneCycleLR has no closed form in dsfunc: the engine steps it and follows the lr it writes, as DeepSpeed."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(net)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=False)
    client = torch.optim.AdamW(net.parameters(), lr=0.01)
    mine = torch.optim.lr_scheduler.OneCycleLR(client, max_lr=0.05, total_steps=10, cycle_momentum=False)
    engine, _, _, returned = initialize(model=net, optimizer=client, lr_scheduler=mine,
                                        config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0})
    assert returned is mine
    for _ in steps_beside(engine, reference, opt, sched, 6):
        assert engine.get_lr() == sched.get_last_lr()
    for a, b in zip(net.parameters(), reference.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
