"""The metadata file and the checksums: damaged files are named, and earlier checkpoints still load."""

from __future__ import annotations

import importlib.metadata
import json
import re

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.cli import export as cli_export
from tests.checkpoint.common import trained
from tests.models import MLP, config, mlp_batches


def test_damaged_files_are_named_and_earlier_checkpoints_still_load(tmp_path):
    torch.manual_seed(0)
    batches = mlp_batches(2, 4)
    state = trained(MLP(), config(), batches, 1)
    ckpt.save_checkpoint(state, tmp_path)
    state = dsfunc.train_step(state, batches[1])
    ckpt.save_checkpoint(state, tmp_path)
    shard = tmp_path / "global_step2" / "__0_0.distcp"
    data = shard.read_bytes()
    template = dsfunc.init_state(MLP(), config())

    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointCorruptError,
                       match=rf"__0_0.distcp is {len(data) // 2} bytes but {len(data)} were written "
                             r"\(truncated\)"
                             r".*load an earlier checkpoint with tag=... \('global_step1'\)"):
        ckpt.load_checkpoint(tmp_path, template)
    shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(ckpt.CheckpointCorruptError, match="__0_0.distcp does not match the sha256"):
        ckpt.load_checkpoint(tmp_path, template)
    shard.unlink()
    with pytest.raises(ckpt.CheckpointCorruptError, match="__0_0.distcp is missing"):
        ckpt.load_checkpoint(tmp_path, template)
    (tmp_path / "global_step2" / ckpt.META_FILE).write_text("{not json")
    with pytest.raises(ckpt.CheckpointCorruptError, match="cannot read .*dsfunc_checkpoint.json"):
        ckpt.load_checkpoint(tmp_path, template)
    assert not template.donated
    loaded, _ = ckpt.load_checkpoint(tmp_path, template, tag="global_step1")
    assert int(loaded.step) == 1


def test_the_version_recorded_is_the_installed_distributions(tmp_path):
    """One source for dsfunc's version: pyproject.toml, as the installed distribution reports it."""
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), tmp_path, tag="v")
    recorded = json.loads((tmp_path / "v" / ckpt.META_FILE).read_text())["dsfunc_version"]
    assert recorded == dsfunc.__version__ == importlib.metadata.version("dsfunc")


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (how the metadata is damaged, the field and problem the error names)
DAMAGE = [
    (lambda m: m["files"][".metadata"].pop("sha256"), r"files\['.metadata'\].sha256 is missing"),
    (lambda m: m["files"]["__0_0.distcp"].update(bytes="12"), r"files\['__0_0.distcp'\].bytes is '12', not an integer"),
    (lambda m: m["files"]["client_state.pt"].update(sha256="x"), r"files\['client_state.pt'\].sha256 is not a sha256"),
    (lambda m: m["units"][0].update(numel=10**12),
     r"units and buffers hold 4,000,000,\d{3},\d{3} bytes of tensors, but the files listed hold [\d,]+ bytes in all"),
    (lambda m: m.update(units={"root": 1}), r"units is \{'root': 1\}, not a list"),
    (lambda m: m["units"][0]["params"][0].update(shape=[-1]), r"units\[0\].params\[0\].shape\[0\] is -1, less than 0"),
    (lambda m: m["units"][0]["params"][0].update(shape=[10**6]), r"units\[0\].params\[0\] lies past the end of its unit"),
    (lambda m: m["units"][0]["params"][0].update(aliases=[1]), r"units\[0\].params\[0\].aliases\[0\] is 1, not a string"),
    (lambda m: m["units"][0]["params"][0].pop("offset"), r"units\[0\].params\[0\].offset is missing"),
    (lambda m: m["tensors"]["step"].update(dtype="load"), r"tensors\['step'\].dtype is 'load', not a torch dtype"),
    (lambda m: m["tensors"]["step"].update(unit="nope"), r"tensors\['step'\].unit names 'nope', which is not among"),
    (lambda m: m["state_dict"].__setitem__(0, ["x", "param", "nope"]), r"state_dict\[0\] names the param 'nope'"),
    (lambda m: m["state_dict"].__setitem__(0, "x"), r"state_dict\[0\] is not \[name, kind, source\]"),
    (lambda m: m.update(precision="fp8"), r"precision is 'fp8', not one of fp16, bf16, fp32"),
    (lambda m: m.pop("scaler"), r"scaler is missing"),
    (lambda m: m.update(step="3"), r"step is '3', not an integer"),
    (lambda m: m.update(format_version="1"), r"format_version is '1', not an integer"),
    (lambda m: m.update(buffers=[]), r"buffers is \[\], not an object"),
    (lambda m: m["units"][0]["params"].append(json.loads(_nested(900))), r"units\[0\].params\[4\] is \[\[\[\[\[\[\[\.\.\.\]\]\]\]\]\]\], not an object"),
]


@pytest.mark.parametrize("damage, named", DAMAGE)
def test_valid_json_of_the_wrong_shape_is_named_by_field_in_load_and_export(tmp_path, capsys, damage, named):
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), tmp_path, tag="t")
    path = tmp_path / "t" / ckpt.META_FILE
    meta = json.loads(path.read_text())
    damage(meta)
    path.write_text(json.dumps(meta))
    expected = (rf"{path} is damaged: {named}.*\. It was altered or not written by dsfunc; load another checkpoint "
                r"\(tag=\.\.\.\), or save this state again")
    template = dsfunc.init_state(MLP(), config())
    with pytest.raises(ckpt.CheckpointCorruptError, match=expected):
        ckpt.load_checkpoint(tmp_path, template)
    assert not template.donated
    assert cli_export([str(tmp_path), str(tmp_path / "w.safetensors")]) == 1
    assert re.match(rf"dsfunc export: error: {expected}", capsys.readouterr().err)


def test_metadata_nested_deeper_than_json_reads_is_named(tmp_path, capsys):
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), tmp_path, tag="t")
    path = tmp_path / "t" / ckpt.META_FILE
    path.write_text(path.read_text()[:-1] + f', "config2": {_nested(200_000)}}}')
    expected = rf"cannot read {path}: RecursionError"
    with pytest.raises(ckpt.CheckpointCorruptError, match=expected):
        ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))
    assert cli_export([str(tmp_path), str(tmp_path / "w.safetensors")]) == 1
    assert re.match(rf"dsfunc export: error: {expected}", capsys.readouterr().err)
