"""Checkpoints without the frozen parameters (DeepSpeed's ``exclude_frozen_parameters`` and
``load_module_strict=False``, what the HF Trainer uses for a PEFT model): the LoRA case in one process."""

from __future__ import annotations

import json

import pytest
import torch

import dsfunc
from dsfunc.checkpoint.dcp_io import read_index
from dsfunc.checkpoint.paths import META_FILE
from dsfunc.deepspeed import initialize
from tests.models import CLIP, MLP, SGD, config, mlp_batches, relative_diff

FROZEN = ("inp.weight", "inp.bias")
BATCHES = mlp_batches(4, 2)


def engine_of(seed: int = 0, frozen: bool = True, stage: int = 0):
    """An engine over the MLP whose first layer (the "base model") does not train, SGD with momentum, clipped."""
    torch.manual_seed(seed)
    model = MLP()
    model.inp.requires_grad_(not frozen)
    cfg = config(micro=2, stage=stage, gradient_clipping=CLIP)
    cfg["optimizer"] = SGD
    engine, *_ = initialize(model=model, config=cfg)
    return engine


def train(engine, batches) -> None:
    for x, y in batches:
        engine.backward(engine(x, y))
        engine.step()


def folder_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpoint_without_frozen_parameters_resumes_as_an_uninterrupted_run(tmp_path, stage):
    uninterrupted = engine_of(stage=stage)
    train(uninterrupted, BATCHES)

    saving = engine_of(stage=stage)
    train(saving, BATCHES[:2])
    saving.save_checkpoint(str(tmp_path), tag="lean", exclude_frozen_parameters=True)
    saving.save_checkpoint(str(tmp_path), tag="full")
    saved = dsfunc.full_params(saving.state)
    meta = json.loads((tmp_path / "lean" / META_FILE).read_text())
    stored = set(read_index(tmp_path / "lean").state_dict_metadata)
    assert not set(FROZEN) & (set(meta["buffers"]) | {k for k, _, _ in meta["state_dict"]})
    assert not {f"buffers/{n}" for n in FROZEN} & (stored | set(meta["tensors"]))
    assert {f"buffers/{n}" for n in FROZEN} <= set(read_index(tmp_path / "full").state_dict_metadata)
    assert folder_bytes(tmp_path / "lean") < folder_bytes(tmp_path / "full")

    resumed = engine_of(stage=stage)
    with pytest.raises(dsfunc.CheckpointError, match="leaves out the frozen parameters inp.weight, inp.bias "
                       r"\(saved with exclude_frozen_parameters=True\): pass load_module_strict=False"):
        resumed.load_checkpoint(str(tmp_path), tag="lean")
    resumed.load_checkpoint(str(tmp_path), tag="lean", load_module_strict=False)
    assert resumed.global_steps == 2
    assert relative_diff(dsfunc.full_params(resumed.state), saved) == 0.0
    train(resumed, BATCHES[2:])
    assert relative_diff(dsfunc.full_params(resumed.state), dsfunc.full_params(uninterrupted.state)) == 0.0


def test_frozen_parameters_the_checkpoint_lacks_keep_the_engines_values(tmp_path):
    saving = engine_of(seed=0)
    train(saving, BATCHES[:2])
    saving.save_checkpoint(str(tmp_path), tag="lean", exclude_frozen_parameters=True)
    saved = dsfunc.full_params(saving.state)
    other = engine_of(seed=1)  # another base model: its frozen values stay, the trained ones are the checkpoint's
    own = {n: dsfunc.full_params(other.state)[n].clone() for n in FROZEN}
    other.load_checkpoint(str(tmp_path), tag="lean", load_module_strict=False)
    loaded = dsfunc.full_params(other.state)
    assert all(torch.equal(loaded[n], own[n]) and not torch.equal(own[n], saved[n]) for n in FROZEN)
    assert relative_diff({k: v for k, v in loaded.items() if k not in FROZEN},
                         {k: v for k, v in saved.items() if k not in FROZEN}) == 0.0


def test_a_missing_trainable_parameter_or_an_unexpected_one_is_refused_without_strict(tmp_path):
    engine_of().save_checkpoint(str(tmp_path), tag="lean", exclude_frozen_parameters=True)
    trains_all = engine_of(frozen=False)  # inp trains here: the checkpoint lacks parameters it would train
    with pytest.raises(dsfunc.CheckpointError, match=r"does not match this model:\n  in the model but not in the "
                       r"checkpoint \(2\):\n    inp.bias\n    inp.weight"):
        trains_all.load_checkpoint(str(tmp_path), tag="lean", load_module_strict=False)
    trains_all.save_checkpoint(str(tmp_path), tag="trained", exclude_frozen_parameters=True)
    frozen = engine_of()  # the checkpoint trains inp, which is frozen here
    with pytest.raises(dsfunc.CheckpointError, match=r"in the checkpoint but not in the model \(2\):\n    inp.bias"):
        frozen.load_checkpoint(str(tmp_path), tag="trained", load_module_strict=False)
    assert trains_all.global_steps == frozen.global_steps == 0
