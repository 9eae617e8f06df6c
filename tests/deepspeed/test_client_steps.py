"""What libraries built on DeepSpeed drive from outside the engine: a client lr scheduler through the
optimizer's ``param_groups`` (kept in checkpoints), the accumulation boundary the client declares, and a lone
process's one-process group; torch.optim is the reference."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import dsfunc as deepspeed
from tests.models import MLP, config, mlp_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torch_run(net: torch.nn.Module, batches, lr_at) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    for x, y in batches:
        net(x, y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 3])
# torch warns that the client optimizer's own step() never ran: the engine steps (accelerate's wrapper does call it)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_a_torch_scheduler_on_the_client_optimizer_drives_the_step(stage, tmp_path):
    torch.manual_seed(0)
    net = MLP()
    want = _torch_run(copy.deepcopy(net), mlp_batches(4, 4), lambda s: 0.5 ** s)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # not passed: it writes param_groups
    cfg = {k: v for k, v in config(micro=4, stage=stage).items() if k != "optimizer"}
    engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    assert optimizer.param_groups is opt.param_groups or optimizer.param_groups[0] is opt.param_groups[0]
    for i, (x, y) in enumerate(mlp_batches(4, 4)):
        engine.backward(engine(x, y))
        engine.step()
        sched.step()
        assert engine.get_lr() == [pytest.approx(1e-2 * 0.5 ** (i + 1))]
        if i == 1:
            engine.save_checkpoint(tmp_path)
    assert engine.state.metrics.lr.item() == pytest.approx(1e-2 * 0.5 ** 3)  # the last step's
    got = {k: v.detach() for k, v in deepspeed.full_params(engine.state).items()}
    assert max((got[k] - want[k]).abs().max().item() for k in got) < 1e-6
    optimizer.param_groups[0]["lr"] = 0.123  # a client's write persists until it writes again
    engine.load_checkpoint(tmp_path)  # the saved lr comes back
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 2)
    optimizer.param_groups[0]["weight_decay"] = 0.5
    x, y = mlp_batches(1, 4)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match=r"param_groups \['weight_decay'\] were changed"):
        engine.step()


def test_the_config_schedule_writes_param_groups_after_a_client_write():
    cfg = config(micro=4, scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                     "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, optimizer, _, scheduler = deepspeed.initialize(model=MLP(), config=cfg)
    x, y = mlp_batches(1, 4)[0]
    optimizer.param_groups[0]["lr"] = 0.5  # this step uses it, as DeepSpeed's; the schedule writes the next
    engine.backward(engine(x, y))
    engine.step()
    assert engine.state.metrics.lr.item() == pytest.approx(0.5)
    assert scheduler.get_last_lr() == engine.get_lr() == [pytest.approx(0.0)]  # WarmupLR at t = 0


def test_the_client_declares_the_accumulation_boundary():
    """accelerate's loop: each micro-batch's backward, one engine.step() at the boundary it declared."""
    torch.manual_seed(0)
    net = MLP()
    batches = mlp_batches(4, 4)
    ref, *_ = deepspeed.initialize(model=copy.deepcopy(net), config=config(micro=4, gas=2))
    for x, y in batches:
        ref.backward(ref(x, y))
        ref.step()
    engine, *_ = deepspeed.initialize(model=net, config=config(micro=4, gas=2))
    for i, (x, y) in enumerate(batches):
        loss = engine(x, y)
        engine.set_gradient_accumulation_boundary(i % 2 == 1)  # after the forward, as accelerate does
        assert engine.is_gradient_accumulation_boundary() == (i % 2 == 1)
        engine.backward(loss)
        if i % 2 == 1:
            engine.step()
    assert engine.global_steps == ref.global_steps == 2
    assert engine.state.metrics.loss.item() == pytest.approx(ref.state.metrics.loss.item())  # the mean, not a sum
    a, b = deepspeed.full_params(engine.state), deepspeed.full_params(ref.state)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_lone_process_gets_a_one_process_group():
    code = ("import torch.distributed as d, dsfunc as deepspeed; from tests.models import MLP, config\n"
            "deepspeed.initialize(model=MLP(), config=config())\n"
            "print(d.is_initialized(), d.get_world_size(), d.get_rank())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[-3:] == ["True", "1", "0"]
