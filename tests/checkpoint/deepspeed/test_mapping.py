"""How a DeepSpeed checkpoint fills a template: one unit at a time, checked against the model and the
optimizer first, and only the parts asked for."""

from __future__ import annotations

import optree
import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.checkpoint.deepspeed.mapping import IMPORT_STATS
from tests.checkpoint.deepspeed.common import Case, Net
from tests.models import MLP, relative_diff

UNIT_TENSORS = 3  # a unit's master weights and its two Adam moments


@pytest.mark.parametrize("name", ["s0_w1_fp32", "s2_w2_bf16", "s3_w2_fp32"])
def test_the_import_never_holds_more_than_two_units(ds_root, name):
    case = Case(int(name[1]), int(name[4]), name[6:])
    state = dsfunc.init_state(Net(), case.config(world=1, stage=0))
    units = state.program.plan.units
    assert len(units) == 5
    IMPORT_STATS.max_elements = 0
    state, _ = dsfunc.load_checkpoint(ds_root / name, state)
    largest = max(u.numel for u in units) * UNIT_TENSORS
    model = sum(u.numel for u in units) * UNIT_TENSORS
    assert IMPORT_STATS.max_elements <= 2 * largest < model, (IMPORT_STATS.max_elements, largest, model)
    assert IMPORT_STATS.max_elements == largest  # exactly one unit at a time
    assert IMPORT_STATS.live == 0


def test_another_model_is_a_mismatch_naming_the_parameters(ds_root):
    state = dsfunc.init_state(MLP(), Case(2, 2, "bf16").config(world=1))
    with pytest.raises(dsfunc.CheckpointMismatchError, match=r"in the checkpoint but not in the model \(\d+\):(.|\n)*emb\.weight"
                                                            r"(.|\n)*in the model but not in the checkpoint \(\d+\):(.|\n)*inp\.weight"):
        dsfunc.load_checkpoint(ds_root / "s2_w2_bf16", state)
    assert not state.donated


class Wider(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks[2] = nn.Sequential(nn.Linear(8, 9), nn.Tanh())


def test_a_shape_change_is_named(ds_root):
    state = dsfunc.init_state(Wider(), Case(3, 2, "fp32").config(world=1))
    with pytest.raises(dsfunc.CheckpointMismatchError, match=r"different \(\d+\):\n    blocks\.2\.0\.bias \(checkpoint \(8,\)"):
        dsfunc.load_checkpoint(ds_root / "s3_w2_fp32", state)


def test_another_optimizer_takes_the_weights_only_when_asked(ds_root):
    case = Case(1, 2, "fp32")
    cfg = case.config(world=1) | {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    state = dsfunc.init_state(Net(), cfg)
    with pytest.raises(dsfunc.CheckpointMismatchError, match="load_optimizer_states=False"):
        dsfunc.load_checkpoint(ds_root / case.name, state)
    state, client = dsfunc.load_checkpoint(ds_root / case.name, state, load_optimizer_states=False)
    adam_loaded = dsfunc.full_params(dsfunc.load_checkpoint(
        ds_root / case.name, dsfunc.init_state(Net(), case.config(world=1)))[0])
    assert relative_diff(dsfunc.full_params(state), adam_loaded) == 0.0
    assert int(state.step) == 3 and client["epoch"] == 3
    assert all(t.abs().sum() == 0 for t in optree.tree_leaves(state.opt_state) if t.dim() > 0)  # fresh momentum


def test_module_only_keeps_the_templates_counters_and_moments(ds_root):
    case = Case(3, 1, "bf16")
    template = dsfunc.init_state(Net(), case.config())
    fresh = [t.clone() for t in optree.tree_leaves(template.opt_state)]
    state, _ = dsfunc.load_checkpoint(ds_root / case.name, template, load_module_only=True)
    assert int(state.step) == 0
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(state.opt_state), fresh))
    full, _ = dsfunc.load_checkpoint(ds_root / case.name, dsfunc.init_state(Net(), case.config()))
    assert relative_diff(dsfunc.full_params(state), dsfunc.full_params(full)) == 0.0


def test_the_lr_schedule_can_start_afresh(ds_root):
    case = Case(2, 1, "fp32")
    state, _ = dsfunc.load_checkpoint(ds_root / case.name, dsfunc.init_state(Net(), case.config()),
                                      load_lr_scheduler_states=False)
    chain = state.opt_state["optimizer"]
    assert int(chain["lr"].count) == 0 and int(chain["adam"].count) == 3
