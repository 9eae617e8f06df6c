"""DeepSpeed's checkpoint files rewritten to run code when unpickled: the import (load_checkpoint) and the
export refuse each with an error naming the file and the opt-in, and no code runs."""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.deepspeed.common import Case, Net
from tests.checkpoint.tampering import Payload

# (case, file): rank 0's model states (counters, client state), a ZeRO shard of rank 1, ZeRO-3's per-rank
# model states of rank 1
FILES = [("s1_w1_fp32", "mp_rank_00_model_states.pt"), ("s1_w2_fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
         ("s3_w2_bf16", "zero_pp_rank_1_mp_rank_00_model_states.pt")]


def _tampered(ds_root: Path, tmp_path: Path, case: str, file: str) -> tuple[Path, Path, Path]:
    save_dir = shutil.copytree(ds_root / case, tmp_path / "ds")
    path = save_dir / "global_step3" / file
    saved = torch.load(path, weights_only=False)  # the fixture DeepSpeed wrote: trusted
    marker = tmp_path / "marker"
    saved["planted"] = Payload(marker)
    torch.save(saved, path)
    return save_dir, path, marker


def _config(case: str) -> dict:
    stage, world, precision = int(case[1]), int(case[4]), case[6:]
    return Case(stage, world, precision).config(world=1, stage=0)


@pytest.mark.parametrize("reader", ["load_checkpoint", "export_fp32", "export_hf"])
@pytest.mark.parametrize("case, file", FILES)
def test_a_tampered_deepspeed_file_is_refused_and_runs_no_code(ds_root, tmp_path, case, file, reader):
    save_dir, path, marker = _tampered(ds_root, tmp_path, case, file)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    read = {"load_checkpoint": lambda: dsfunc.load_checkpoint(save_dir, dsfunc.init_state(Net(), _config(case))),
            "export_fp32": lambda: ckpt.export_fp32(save_dir, tmp_path / "w.safetensors"),
            "export_hf": lambda: ckpt.export_hf(save_dir, tmp_path / "out", hf)}[reader]
    with pytest.raises(dsfunc.CheckpointError, match=r"holds an object of class posix\.system .*trust_pickle=True") \
            as e:
        read()
    assert str(path) in str(e.value)
    assert not marker.exists(), f"reading the tampered {file} ran its code"


def test_trust_pickle_runs_the_payload_and_still_loads(ds_root, tmp_path):
    """The test above can fail: trusted, the same file's payload runs."""
    case, file = FILES[0]
    save_dir, _, marker = _tampered(ds_root, tmp_path, case, file)
    state, client = dsfunc.load_checkpoint(save_dir, dsfunc.init_state(Net(), _config(case)), trust_pickle=True)
    assert marker.exists() and int(state.step) == 3 and client["planted"] == 0  # os.system's exit status


def test_a_client_tensor_whose_attributes_shadow_clone_comes_back_as_the_tensor(ds_root, tmp_path):
    """A pickled tensor may carry instance attributes; one named ``clone`` (an allowed class here) must not
    replace the tensor that the load copies out of the file."""
    case, file = FILES[0]
    save_dir = shutil.copytree(ds_root / case, tmp_path / "ds")
    path = save_dir / "global_step3" / file
    saved = torch.load(path, weights_only=False)
    saved["tensor"].clone = collections.OrderedDict
    torch.save(saved, path)
    _, client = dsfunc.load_checkpoint(save_dir, dsfunc.init_state(Net(), _config(case)))
    assert type(client["tensor"]) is torch.Tensor and torch.equal(client["tensor"], torch.arange(4))
