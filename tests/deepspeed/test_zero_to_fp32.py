"""``deepspeed.utils.zero_to_fp32`` on dsfunc: the same tensors as real DeepSpeed 0.19.8's on checkpoints real
DeepSpeed wrote (tests/checkpoint/deepspeed's fixtures), the same files from the conversion, and dsfunc's own
checkpoints, whose ZeRO saves leave the recovery script DeepSpeed users run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import dsfunc
from dsfunc.checkpoint.recovery import SCRIPT_NAME
from dsfunc.deepspeed import zero_to_fp32 as ours
from tests.checkpoint.deepspeed.common import Net, extract
from tests.models import MLP, config, mlp_batches

ROOT = Path(__file__).resolve().parents[2]
CASES = ["s1_w2_bf16", "s2_w2_fp16", "s2_w1_fp32", "s3_w2_bf16", "s3_w1_fp32"]


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract(tmp_path_factory.mktemp("deepspeed"))


@pytest.fixture(scope="module")
def theirs():
    return pytest.importorskip("deepspeed.utils.zero_to_fp32")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype and torch.equal(tensor, b[name]), name


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("exclude_frozen", [False, True])
def test_state_dict_as_real_deepspeed(ds_root, theirs, case, exclude_frozen):
    got = ours.get_fp32_state_dict_from_zero_checkpoint(ds_root / case, exclude_frozen_parameters=exclude_frozen)
    expected = theirs.get_fp32_state_dict_from_zero_checkpoint(str(ds_root / case),
                                                               exclude_frozen_parameters=exclude_frozen)
    # the module's names in its order, every tensor fp32 (DeepSpeed keeps a frozen parameter in its training
    # dtype at stage 3, and leaves it out at stage 1 under bf16: its bf16 optimizer saves no frozen fragments)
    assert list(got) == [k for k in Net().state_dict() if not (exclude_frozen and k == "frozen")]
    assert set(expected) == set(got) - ({"frozen"} if case == "s1_w2_bf16" else set())
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor.float()), name
    assert got["head.weight"] is got["emb.weight"]  # tied names share one tensor


@pytest.mark.parametrize("safe", [False, True])
@pytest.mark.parametrize("shard", ["5GB", "1KB"])
def test_conversion_writes_deepspeeds_files(ds_root, theirs, tmp_path, safe, shard):
    case = ds_root / "s3_w2_bf16"
    ours.convert_zero_checkpoint_to_fp32_state_dict(case, tmp_path / "ours", max_shard_size=shard,
                                                    safe_serialization=safe)
    try:
        theirs.convert_zero_checkpoint_to_fp32_state_dict(str(case), str(tmp_path / "theirs"), max_shard_size=shard,
                                                          safe_serialization=safe)
    except RuntimeError as e:  # DeepSpeed's safetensors writer refuses tied (shared) tensors
        assert safe and "share memory" in str(e)
        reference = None
    else:
        reference = sorted(os.listdir(tmp_path / "theirs"))
    files = sorted(os.listdir(tmp_path / "ours"))
    if reference is not None:
        assert files == reference
    index = [f for f in files if f.endswith(".index.json")]
    assert (len(index) == 1) == (shard == "1KB")
    weight_map = json.loads((tmp_path / "ours" / index[0]).read_text())["weight_map"] if index else \
        dict.fromkeys(Net().state_dict(), files[0])
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        path = tmp_path / "ours" / file
        loaded |= safetensors.torch.load_file(path) if safe else torch.load(path, weights_only=True)
    assert sorted(loaded) == sorted(weight_map) == sorted(Net().state_dict())
    plain = Net()
    plain.load_state_dict(loaded)  # strict
    expected = ours.get_fp32_state_dict_from_zero_checkpoint(case)
    _same({k: v for k, v in plain.state_dict().items()}, expected)


def _trained_checkpoint(save_dir: Path, stage: int) -> dsfunc.TrainState:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), config(micro=8, stage=stage))
    for x, y in mlp_batches(2, 8):
        state = dsfunc.train_step(state, (x, y))
    dsfunc.save_checkpoint(state, save_dir)
    return state


def test_dsfunc_checkpoint_and_the_recovery_script(tmp_path):
    save_dir = tmp_path / "ckpt"
    state = _trained_checkpoint(save_dir, stage=2)
    expected = dsfunc.full_params(state)
    got = ours.get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert list(got) == list(MLP().state_dict())
    _same(got, expected)
    model = ours.load_state_dict_from_zero_checkpoint(MLP(), save_dir, tag="global_step2")
    _same(dict(model.state_dict()), expected)

    script = save_dir / SCRIPT_NAME
    assert os.access(script, os.X_OK)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(script), str(save_dir), str(tmp_path / "out"), "--safe_serialization"],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    _same(safetensors.torch.load_file(tmp_path / "out" / "model.safetensors"), expected)
    swapped = subprocess.run([sys.executable, "-m", "dsfunc.deepspeed.zero_to_fp32", str(tmp_path / "nothing"),
                              str(save_dir)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert swapped.returncode != 0 and "the checkpoint comes first, then the output directory" in swapped.stderr


def test_no_recovery_script_without_zero(tmp_path):
    _trained_checkpoint(tmp_path, stage=0)
    assert not (tmp_path / SCRIPT_NAME).exists()


def test_as_deepspeed_import_and_module_run(ds_root, tmp_path):
    """Under DSFUNC_AS_DEEPSPEED=1 a script's ``from deepspeed.utils.zero_to_fp32 import ...`` is dsfunc's, and
    ``python -m deepspeed.utils.zero_to_fp32`` runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DSFUNC_AS_DEEPSPEED="1")
    code = ("from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as f, "
            "convert_zero_checkpoint_to_fp32_state_dict, load_state_dict_from_zero_checkpoint; print(f.__module__)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.stdout.strip() == "dsfunc.deepspeed.zero_to_fp32", run.stderr
    run = subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ds_root / "s2_w2_fp16"),
                          str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    _same(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True),
          ours.get_fp32_state_dict_from_zero_checkpoint(ds_root / "s2_w2_fp16"))
