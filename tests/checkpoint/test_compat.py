"""Whether a checkpoint fits the template: another model, units, optimizer or precision."""

from __future__ import annotations

import json

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.common import FP16, Tied, trained
from tests.models import MLP, config, mlp_batches


def test_model_mismatch_lists_parameters(tmp_path):
    ckpt.save_checkpoint(dsfunc.init_state(MLP(width=8, depth=3), config()), tmp_path)
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(width=10, depth=2), config()))
    message = str(info.value)
    assert "in the checkpoint but not in the model (2):\n    blocks.2.0.bias\n    blocks.2.0.weight\n" in message
    assert "\n    inp.weight (checkpoint (8, 6), the model (10, 6))\n" in message
    assert "Build the template state from the model the checkpoint was saved from" in message
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"in the model but not in the checkpoint \(\d+\):\n(.|\n)*\(buffer\)"):
        ckpt.load_checkpoint(tmp_path, dsfunc.init_state(Tied(), config()))
    other_units = dsfunc.init_state(MLP(), config(), unit_modules=["blocks.0"])
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"into units \['root', 'blocks.0', .*unit_modules"):
        ckpt.load_checkpoint(tmp_path, other_units)


def test_entries_the_checkpoint_lacks_are_named_before_the_template_is_touched(tmp_path):
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), tmp_path)
    meta_file = tmp_path / "global_step0" / ckpt.META_FILE
    meta = json.loads(meta_file.read_text())
    del meta["tensors"]["metrics/lr"]  # as if saved by a dsfunc that did not record this metric yet
    meta_file.write_text(json.dumps(meta))
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))  # metrics are optional
    assert int(loaded.step) == 0
    del meta["tensors"]["rng"]
    meta_file.write_text(json.dumps(meta))
    template = dsfunc.init_state(MLP(), config())
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"has no rng, which this state needs"):
        ckpt.load_checkpoint(tmp_path, template)
    assert not template.donated


def test_another_optimizer_is_named_and_can_start_fresh(tmp_path):
    torch.manual_seed(0)
    state = trained(MLP(), config(), mlp_batches(2, 4), 2)
    full = dsfunc.full_params(state)
    ckpt.save_checkpoint(state, tmp_path)
    sgd = config(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"optimizer 'adamw'\) does not fit this state's optimizer \('sgd'\)(.|\n)*"
                             r"in the checkpoint but not in this state's optimizer \(\d+\):\n(.|\n)*optimizer/adam/count"
                             r"(.|\n)*load_optimizer_states=False"):
        ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), sgd))
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), sgd), load_optimizer_states=False)
    assert int(loaded.step) == 2
    assert all(torch.equal(full[k], v) for k, v in dsfunc.full_params(loaded).items())
    loaded = dsfunc.train_step(loaded, mlp_batches(1, 4)[0])
    assert torch.isfinite(loaded.metrics.loss)


def test_precision_changes_keep_masters_and_reset_an_incompatible_scaler(tmp_path):
    torch.manual_seed(0)
    state = trained(MLP(), config(fp16=FP16), mlp_batches(3, 4), 3)
    ckpt.save_checkpoint(state, tmp_path)
    full, scale = dsfunc.full_params(state), float(state.scaler.scale)
    assert scale != 2.0**20
    for target in ({}, {"bf16": {"enabled": True}}, {"fp16": {**FP16, "initial_scale_power": 10}}):
        template = dsfunc.init_state(MLP(), config(**target))
        fresh_scale = float(template.scaler.scale)
        loaded, _ = ckpt.load_checkpoint(tmp_path, template)
        assert all(torch.equal(full[k], v) for k, v in dsfunc.full_params(loaded).items())
        expected = scale if "fp16" in target else fresh_scale  # same precision and scaler kind: resumed
        assert float(loaded.scaler.scale) == expected
        mu = loaded.opt_state["optimizer"]["adam"].mu["root"]
        assert torch.equal(mu, state.opt_state["optimizer"]["adam"].mu["root"])
