"""The metadata file and the checksums: damaged files are named, and earlier checkpoints still load."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
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
