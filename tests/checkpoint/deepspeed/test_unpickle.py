"""DeepSpeed's pickles: read without DeepSpeed and without full unpickling; the client state's own objects
only with ``trust_pickle=True``."""

from __future__ import annotations

import fractions
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc.checkpoint.deepspeed.unpickle import DeepSpeedObject, load_file
from tests.checkpoint.deepspeed.common import CLIENT, Case, Net

NO_DEEPSPEED = """
import sys
sys.modules["deepspeed"] = None  # importing it now fails
import dsfunc
from tests.checkpoint.deepspeed.common import Case, Net
for name in sys.argv[1:]:
    case = Case(int(name[1]), int(name[4]), name[6:10])
    state, client = dsfunc.load_checkpoint(name, dsfunc.init_state(Net(), case.config(world=1, stage=0)))
    assert client["epoch"] == 3, client
print("ok")
"""


def test_deepspeed_is_not_needed(ds_root):
    cases = ["s2_w2_fp16", "s3_w2_bf16", "s0_w1_fp32"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    run = subprocess.run([sys.executable, "-c", NO_DEEPSPEED, *cases], check=False, cwd=ds_root,
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_deepspeeds_objects_become_plain_stand_ins(ds_root):
    optim = load_file(ds_root / "s2_w2_fp16" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    osd = optim["optimizer_state_dict"]
    scaler, fragment = osd["loss_scaler"], next(iter(osd["param_slice_mappings"][0].values()))
    assert isinstance(scaler, DeepSpeedObject) and scaler.ds_class.endswith("DynamicLossScaler")
    assert vars(scaler)["cur_scale"] == 4096 and vars(scaler)["delayed_shift"] == 2
    assert fragment.ds_class.endswith("fragment_address") and fragment.numel > 0
    assert osd["zero_stage"] == 2 and type(osd["zero_stage"]) is int


def test_a_client_object_needs_trust_pickle(ds_root, tmp_path):
    save_dir = shutil.copytree(ds_root / "s1_w1_fp32", tmp_path / "ds")
    main = save_dir / "global_step3" / "mp_rank_00_model_states.pt"
    saved = torch.load(main, weights_only=True)
    saved["ratio"] = fractions.Fraction(1, 3)  # what DeepSpeed writes for client_state={"ratio": Fraction(1, 3)}
    torch.save(saved, main)
    config = Case(1, 1, "fp32").config()
    state = dsfunc.init_state(Net(), config)
    with pytest.raises(dsfunc.CheckpointError, match=r"class fractions\.Fraction .*trust_pickle=True") as e:
        dsfunc.load_checkpoint(save_dir, state)
    assert str(main) in str(e.value) and not state.donated
    state, client = dsfunc.load_checkpoint(save_dir, state, trust_pickle=True)
    assert client["ratio"] == fractions.Fraction(1, 3) and client["note"] == CLIENT["note"]
    assert int(state.step) == 3
