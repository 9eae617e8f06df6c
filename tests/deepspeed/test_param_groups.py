"""Parameter groups through the engine: model_parameters dicts and a client optimizer's param_groups equal
torch.optim with the same groups, and DeepSpeed's lr schedulers set every group as real DeepSpeed's do."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from dsfunc.deepspeed import initialize
from tests.models import config, relative_diff
from tests.optim.test_groups import NormNet, batches, no_decay, torch_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hf_groups(model, weight_decay=0.1):
    """The grouping every Hugging Face / DeepSpeed-Chat script does."""
    return [{"params": [p for n, p in model.named_parameters() if not no_decay(n)], "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if no_decay(n)], "weight_decay": 0.0, "lr": 2e-2}]


def run(engine, data):
    for x, y in data:
        engine.backward(engine(x, y))
        engine.step()


def test_model_parameters_groups_equal_torch_adamw():
    torch.manual_seed(0)
    model = NormNet()
    data = batches(8, 4)
    expected = torch_reference(model, data)
    net = copy.deepcopy(model)
    cfg = config(micro=4, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    engine, optimizer, _, _ = initialize(model=net, model_parameters=hf_groups(net), config=cfg)
    run(engine, data)
    assert relative_diff(net.state_dict(), expected) < 2e-5  # float32 bias corrections; see tests/optim/test_groups.py
    assert engine.get_lr() == [1e-2, 2e-2]
    groups = optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and [g["lr"] for g in groups] == [1e-2, 2e-2]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for n, p in net.named_parameters() if no_decay(n)}


def test_a_client_optimizers_param_groups_equal_torch():
    torch.manual_seed(0)
    model = NormNet()
    data = batches(8, 4)
    expected = torch_reference(model, data)
    net = copy.deepcopy(model)
    client = torch.optim.AdamW(hf_groups(net), lr=1e-2)
    engine, *_ = initialize(model=net, optimizer=client, config={"train_batch_size": 4, "gradient_clipping": 0.0})
    run(engine, data)
    assert relative_diff(net.state_dict(), expected) < 2e-5


def test_a_torch_scheduler_scales_each_groups_lr():
    torch.manual_seed(0)
    model = NormNet()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(hf_groups(reference), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k))
    seen = []
    for x, y in batches(5, 4):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        reference(x, y).backward()
        opt.step()
        sched.step()
    net = copy.deepcopy(model)
    client = torch.optim.SGD(hf_groups(net), lr=1e-2, momentum=0.9)
    engine, *_ = initialize(model=net, optimizer=client, lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda k: 1 / (1 + k)), config={"train_batch_size": 4, "gradient_clipping": 0.0})
    lrs = []
    for x, y in batches(5, 4):
        lrs.append(engine.get_lr())
        engine.backward(engine(x, y))
        engine.step()
    assert lrs == [pytest.approx(s) for s in seen]
    assert relative_diff(net.state_dict(), reference.state_dict()) < 1e-5


SCHEDULERS = {
    "WarmupLR": {"warmup_num_steps": 4, "warmup_type": "linear"},
    "WarmupLR max": {"warmup_num_steps": 4, "warmup_max_lr": 0.03},
    "WarmupDecayLR": {"warmup_num_steps": 2, "total_num_steps": 6, "warmup_max_lr": 0.03},
    "WarmupCosineLR": {"warmup_num_steps": 2, "total_num_steps": 6, "warmup_min_ratio": 0.1},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.03, "cycle_first_step_size": 2, "cycle_momentum": False},
    "LRRangeTest": {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 2},
}

_DEEPSPEED = """
import json, sys, torch
from deepspeed.runtime import lr_schedules
kind, params, steps = json.loads(sys.argv[1])
opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.01},
                         {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.02}])
sched = getattr(lr_schedules, kind)(opt, **params)
lrs = []
for _ in range(steps):
    lrs.append([g["lr"] for g in opt.param_groups])  # what the step uses
    sched.step()
print(json.dumps(lrs))
"""


def deepspeed_lrs(kind: str, params: dict, steps: int) -> list[list[float]]:
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", _DEEPSPEED, json.dumps([kind, params, steps])], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_deepspeeds_schedulers_set_every_group_as_deepspeed_does(name):
    kind = name.split()[0]
    expected = deepspeed_lrs(kind, SCHEDULERS[name], 7)
    model = NormNet()
    groups = [{"params": [p for n, p in model.named_parameters() if not no_decay(n)], "lr": 0.01},
              {"params": [p for n, p in model.named_parameters() if no_decay(n)], "lr": 0.02}]
    cfg = config(micro=4, optimizer={"type": "AdamW", "params": {"lr": 0.01}},
                 scheduler={"type": kind, "params": SCHEDULERS[name]})
    engine, *_ = initialize(model=model, model_parameters=groups, config=cfg)
    seen = []
    for x, y in batches(7, 4):
        seen.append(engine.get_lr())
        engine.backward(engine(x, y))
        engine.step()
    assert seen == [pytest.approx(e, rel=1e-6) for e in expected]


def test_an_engine_with_groups_resumes_exactly(tmp_path):
    def engine_for(seed_model):
        net = copy.deepcopy(seed_model)
        cfg = config(micro=4, optimizer={"type": "AdamW", "params": {"lr": 1e-2}},
                     scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
        return net, initialize(model=net, model_parameters=hf_groups(net), config=cfg)[0]

    torch.manual_seed(0)
    model = NormNet()
    data = batches(6, 4)
    net, full = engine_for(model)
    run(full, data)
    _, first = engine_for(model)
    run(first, data[:3])
    first.save_checkpoint(tmp_path)
    resumed_net, resumed = engine_for(model)
    resumed.load_checkpoint(tmp_path)
    run(resumed, data[3:])
    assert relative_diff(resumed_net.state_dict(), net.state_dict()) == 0.0
    assert resumed.get_lr() == full.get_lr() and len(resumed.get_lr()) == 2
