"""DeepSpeed's scheduler classes built by hand on a torch optimizer: the same lr, last lr, momentum and counter as
real DeepSpeed's, step by step (one process on CPU: DeepSpeed's schedulers need no distributed setup)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import dsfunc.deepspeed.lr_schedules as ours
from dsfunc.deepspeed import initialize
from dsfunc.errors import InputError
from tests.deepspeed.test_client_objects import steps_beside

CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 7, "warmup_type": "linear"}),  # max: each group's own lr
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_max_lr": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 18, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "cycle_first_stair_count": 2,
                      "decay_lr_rate": 0.1, "decay_step_size": 2, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": [0.01, 0.02], "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "cycle_second_step_size": 6,
                      "cycle_min_mom": [0.8, 0.85], "decay_lr_rate": 0.1, "decay_step_size": 3}),
    ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
    ("LRRangeTest", {"lr_range_test_min_lr": [0.002, 0.001], "lr_range_test_step_size": 4}),
]


def _trace(module, name: str, params: dict, optimizer_cls) -> list:
    """What a script sees over 20 steps: get_lr, get_last_lr, the groups' lr and betas, get_mom, state_dict (and the
    lr bounds, WarmupCosineLR's lr ratio)."""
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    if optimizer_cls is torch.optim.SGD:
        opt = torch.optim.SGD([{"params": [a], "lr": 0.05}, {"params": [b], "lr": 0.07}], momentum=0.9)
    else:
        opt = torch.optim.Adam([{"params": [a], "lr": 0.05}, {"params": [b], "lr": 0.07}], betas=(0.9, 0.999))
    sched = getattr(module, name)(opt, **params)
    bounds = (sched.min_lrs, sched.max_lrs) if hasattr(sched, "max_lrs") else None  # DeepSpeed's per-group bounds
    seen = [(sched.get_lr(), [g["lr"] for g in opt.param_groups], [g.get("betas") for g in opt.param_groups], bounds,
             sched.get_mom() if name == "OneCycle" else None)]
    for _ in range(20):
        sched.step()
        seen.append((sched.get_lr(), sched.get_last_lr(), [g["lr"] for g in opt.param_groups],
                     [g.get("betas") for g in opt.param_groups], sched.get_mom() if name == "OneCycle" else None,
                     sched.state_dict(), sched.get_lr_ratio() if name == "WarmupCosineLR" else None))
    return seen


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.SGD])
@pytest.mark.parametrize("name, params", CASES)
def test_hand_built_matches_deepspeed(name, params, optimizer_cls):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    theirs = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="real DeepSpeed is the reference")
    expected, got = _trace(theirs, name, params, optimizer_cls), _trace(ours, name, params, optimizer_cls)
    assert len(got) == len(expected) == 21
    for step, (e, g) in enumerate(zip(expected, got)):
        assert _close(g, e), (step, e, g)


def _close(got, expected) -> bool:
    """Same structure, numbers equal to 1e-12 relative (DeepSpeed's Python floats vs dsfunc's float64 tensors)."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and got.keys() == expected.keys() and all(_close(got[k], v) for k, v in
                                                                                 expected.items())
    if isinstance(expected, (list, tuple)):
        return type(got) is type(expected) and len(got) == len(expected) and all(map(_close, got, expected))
    if expected is None:
        return got is None
    return type(got) is type(expected) and got == pytest.approx(expected, rel=1e-12, abs=0)


def test_resume_and_explicit_iteration():
    """``step(k)`` jumps to step k and ``load_state_dict`` restores the counter, as DeepSpeed's."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = ours.WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=5, warmup_max_lr=0.1, warmup_type="linear")
    sched.step(4)
    assert sched.last_batch_iteration == 4 and opt.param_groups[0]["lr"] == pytest.approx(0.08)
    other = ours.WarmupDecayLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), total_num_steps=20,
                               warmup_num_steps=5, warmup_max_lr=0.1, warmup_type="linear")
    other.load_state_dict(sched.state_dict())
    assert other.get_lr() == sched.get_lr()


def test_bad_params_are_refused():
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                            {"params": [torch.nn.Parameter(torch.zeros(1))]}])
    with pytest.raises(ValueError, match="warmup_num_steps"):
        ours.WarmupLR(opt, warmup_num_steps=-5)
    with pytest.raises(InputError, match="cycle_min_lr has 3 values"):
        ours.OneCycle(opt, cycle_min_lr=[0.1, 0.2, 0.3], cycle_max_lr=0.5)


@pytest.mark.parametrize("name, params", [CASES[2], CASES[6]])
def test_engine_steps_a_hand_built_scheduler(name, params):
    """``initialize(optimizer=sgd, lr_scheduler=WarmupDecayLR(sgd, ...))`` returns that scheduler and steps it after
    each step, training as torch's SGD (momentum) stepped with real DeepSpeed's scheduler does."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    theirs = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="real DeepSpeed is the reference")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(net)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    sched = getattr(theirs, name)(opt, **params)
    client = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    mine = getattr(ours, name)(client, **params)
    engine, _, _, returned = initialize(model=net, optimizer=client, lr_scheduler=mine,
                                        config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0})
    assert returned is mine and isinstance(returned, getattr(ours, name))
    for _ in steps_beside(engine, reference, opt, sched, 8):
        assert mine.last_batch_iteration == sched.last_batch_iteration
        assert engine.get_lr() == pytest.approx(sched.get_last_lr(), rel=1e-12)
    for ours_p, ref_p in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(ours_p.detach(), ref_p.detach(), rtol=1e-5, atol=1e-6)


def test_engine_refuses_a_hand_built_momentum_cycle():
    net = torch.nn.Linear(4, 2)
    client = torch.optim.Adam(net.parameters(), lr=0.05)
    sched = ours.OneCycle(client, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3)
    with pytest.raises(InputError, match="cycle_momentum=False"):
        initialize(model=net, optimizer=client, lr_scheduler=sched, config={"train_micro_batch_size_per_gpu": 2})


def test_config_onecycle_view_reports_deepspeeds_momentum():
    """The engine's view of a config OneCycle section reports ``get_mom()`` as DeepSpeed's engine's scheduler (built
    on its Adam, stepped after each step) does, and is an instance of the section's class."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    theirs = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="real DeepSpeed is the reference")
    params = {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
              "decay_mom_rate": 1e-3, "cycle_first_step_size": 3, "decay_step_size": 3}
    reference = theirs.OneCycle(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), **params)
    engine, _, _, view = initialize(model=torch.nn.Linear(4, 2), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "OneCycle", "params": params}})
    assert isinstance(view, ours.OneCycle)
    for _ in range(9):
        assert _close(view.get_mom(), reference.get_mom()) and view.get_lr() == pytest.approx(reference.get_lr())
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
        reference.step()
