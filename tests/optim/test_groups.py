"""Parameter groups: per-group options (no weight decay on biases and norms) equal torch.optim with the same
groups; the plan gives each group's parameters of a module a unit of their own; the schedule runs per group."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc.optim import sgd
from tests.models import config, relative_diff
from tests.multiprocess import run_world


class NormNet(nn.Module):
    """Blocks with LayerNorms, the layout of a transformer as far as weight decay goes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(8, 4)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.out(h), y)


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".1." in name  # biases and the LayerNorms


GROUPS = dsfunc.ParamGroups(label=lambda name: "no_decay" if no_decay(name) else "decay",
                            options={"decay": {"weight_decay": 0.1}, "no_decay": {"weight_decay": 0.0, "lr": 2e-2}})


def batches(steps: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)]


def torch_reference(model: nn.Module, data, lr: float = 1e-2) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    rest = [p for n, p in model.named_parameters() if no_decay(n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-2}],
                            lr=lr)
    for x, y in data:
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return model.state_dict()


def test_groups_with_their_own_weight_decay_and_lr_equal_torch_adamw():
    torch.manual_seed(0)
    model = NormNet()
    data = batches(8, 4)
    expected = torch_reference(model, data)
    cfg = config(micro=4, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    state = dsfunc.init_state(model, cfg, param_groups=GROUPS)
    assert [u.name for u in state.program.plan.units][:2] == ["root[decay]", "root[no_decay]"]
    assert "blocks.0[no_decay]" in state.params and "blocks.0" not in state.params
    for batch in data:
        state = dsfunc.train_step(state, batch)
    # float32 bias corrections (dsfunc.optim.scale_by_adam) bound this at ~1e-5 until they are float64
    assert relative_diff(dsfunc.full_params(state), expected) < 2e-5


def test_one_group_keeps_the_plain_layout_and_takes_its_options():
    torch.manual_seed(0)
    model = NormNet()
    cfg = config(micro=4, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.5}})
    state = dsfunc.init_state(model, cfg, param_groups=dsfunc.ParamGroups(lambda n: "all", {"all": {"lr": 0.0}}))
    assert list(state.params) == ["root", "blocks.0", "blocks.1"]
    before = dsfunc.full_params(state)
    state = dsfunc.train_step(state, batches(1, 4)[0])
    assert relative_diff(dsfunc.full_params(state), before) == 0.0  # lr 0 for the one group


def test_a_transform_per_group_is_optax_multi_transform():
    torch.manual_seed(0)
    model = NormNet()
    frozen_norms = dsfunc.ParamGroups(label=lambda name: "fixed" if no_decay(name) else "train")
    state = dsfunc.init_state(model, config(micro=4), param_groups=frozen_norms,
                              optimizer={"train": sgd(lr=0.1), "fixed": sgd(lr=0.0)})
    before = dsfunc.full_params(state)
    state = dsfunc.train_step(state, batches(1, 4)[0])
    after = dsfunc.full_params(state)
    assert all(torch.equal(after[n], before[n]) == no_decay(n) for n in before)
    with pytest.raises(dsfunc.InputError, match=r"transform for each of them \(missing: \['fixed'\]\)"):
        dsfunc.init_state(model, config(micro=4), param_groups=frozen_norms, optimizer={"train": sgd(lr=0.1)})


def test_a_bad_group_option_names_the_group():
    with pytest.raises(dsfunc.ConfigError, match="parameter group 'no_decay'.*weight_deacy.*weight_decay"):
        dsfunc.init_state(NormNet(), config(micro=4), param_groups=dsfunc.ParamGroups(
            lambda n: "no_decay" if no_decay(n) else "decay", {"no_decay": {"weight_deacy": 0.0}}))


def test_the_schedule_runs_per_group_from_its_lr():
    cfg = config(micro=4, optimizer={"type": "AdamW", "params": {"lr": 1e-2}},
                 scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}})
    state = dsfunc.init_state(NormNet(), cfg, param_groups=GROUPS)
    for batch in batches(3, 4):
        state = dsfunc.train_step(state, batch)
    lrs = {label: s["lr"].lr.item() for label, s in state.opt_state["optimizer"].items()}
    # the third step runs at DeepSpeed's t = 1 of 4 warmup steps, each group towards its own lr
    assert lrs == pytest.approx({"decay": 1e-2 * 0.25, "no_decay": 2e-2 * 0.25})


def sharded_groups(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = NormNet()
    cfg = config(micro=2, world=world, stage=stage, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    state = dsfunc.init_state(model, cfg, param_groups=GROUPS)
    for x, y in batches(8, 4):
        state = dsfunc.train_step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
    return dsfunc.full_params(state)


@pytest.mark.parametrize("stage", [1, 3])
def test_groups_on_two_ranks_equal_torch(stage):
    torch.manual_seed(0)
    expected = torch_reference(NormNet(), batches(8, 4))
    for full in run_world(sharded_groups, 2, stage):
        assert relative_diff(full, expected) < 2e-5
