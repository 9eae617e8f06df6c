"""Which folder a directory and tag name: ``latest``, explicit tags, partial folders, a crash between the renames."""

from __future__ import annotations

import os

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.common import trained
from tests.models import MLP, config, mlp_batches


def test_no_checkpoint_or_missing_tag_lists_what_exists(tmp_path):
    template = dsfunc.init_state(MLP(), config())
    with pytest.raises(ckpt.CheckpointNotFoundError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nowhere", template)
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match=r"no `latest` file .* pass tag=.*no complete checkpoint"):
        ckpt.load_checkpoint(tmp_path, template)
    ckpt.save_checkpoint(template, tmp_path, tag="a", save_latest=False)
    ckpt.save_checkpoint(template, tmp_path, tag="b", save_latest=False)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no `latest`.*checkpoints there: 'a', 'b'"):
        ckpt.load_checkpoint(tmp_path, template)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no checkpoint tagged 'c' in .*'a', 'b'"):
        ckpt.load_checkpoint(tmp_path, template, tag="c")
    (tmp_path / "latest").write_text("gone")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"tagged 'gone' \(named by .*latest\)"):
        ckpt.load_checkpoint(tmp_path, template)
    assert not template.donated  # nothing was read into it


def test_partial_and_foreign_folders_are_never_checkpoints(tmp_path):
    template = dsfunc.init_state(MLP(), config())
    ckpt.save_checkpoint(template, tmp_path, tag="good")
    (tmp_path / ".half.tmp-123").mkdir()  # what a crashed save leaves
    (tmp_path / ".half.tmp-123" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"partial")
    assert ckpt.available_tags(tmp_path) == ["good"]
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match=r"half is not a complete dsfunc checkpoint.*'good'"):
        ckpt.load_checkpoint(tmp_path, template, tag="half")
    ckpt.save_checkpoint(template, tmp_path, tag="next")  # tidies what crashed saves left
    assert not (tmp_path / ".half.tmp-123").exists()


def test_overwriting_a_tag_and_a_crash_between_the_renames(tmp_path):
    torch.manual_seed(0)
    batches = mlp_batches(2, 4)
    state = trained(MLP(), config(), batches, 1)
    ckpt.save_checkpoint(state, tmp_path, tag="t")
    state = dsfunc.train_step(state, batches[1])
    ckpt.save_checkpoint(state, tmp_path, tag="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "t"]
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))
    assert int(loaded.step) == 2

    # the state a crash leaves after the old folder was moved aside and before the new one moved in
    os.rename(tmp_path / "t", tmp_path / ".t.replaced")
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))
    assert int(loaded.step) == 2
    ckpt.save_checkpoint(loaded, tmp_path, tag="other")  # the next save puts it back
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "other", "t"]


def test_find_checkpoint_latest_explicit_tag_folder_and_the_replaced_copy(tmp_path):
    state = dsfunc.init_state(MLP(), config())
    ckpt.save_checkpoint(state, tmp_path, tag="a")
    ckpt.save_checkpoint(state, tmp_path, tag="b", save_latest=False)
    assert ckpt.find_checkpoint(tmp_path) == tmp_path / "a"  # the one `latest` names
    assert ckpt.find_checkpoint(str(tmp_path), tag="b") == tmp_path / "b"
    assert ckpt.find_checkpoint(tmp_path / "b") == tmp_path / "b"  # a checkpoint folder itself

    # a save over 'a' that died between its two renames: the complete old one waits in .a.replaced
    os.rename(tmp_path / "a", tmp_path / ".a.replaced")
    assert ckpt.find_checkpoint(tmp_path) == tmp_path / ".a.replaced"
    assert ckpt.find_checkpoint(tmp_path, tag="a") == tmp_path / ".a.replaced"
    loaded, _ = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path), dsfunc.init_state(MLP(), config()))
    assert int(loaded.step) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.replaced", ".lock", "b", "latest"]  # nothing moved


def test_find_checkpoint_not_found_lists_the_tags(tmp_path):
    with pytest.raises(ckpt.CheckpointNotFoundError, match="does not exist"):
        ckpt.find_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no `latest` file .*it holds no complete checkpoint"):
        ckpt.find_checkpoint(tmp_path)
    state = dsfunc.init_state(MLP(), config())
    ckpt.save_checkpoint(state, tmp_path, tag="a", save_latest=False)
    ckpt.save_checkpoint(state, tmp_path, tag="b", save_latest=False)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no `latest` file .*checkpoints there: 'a', 'b'\)$"):
        ckpt.find_checkpoint(tmp_path)
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match=r"no checkpoint tagged 'c' in .*; complete checkpoints there: 'a', 'b'$"):
        ckpt.find_checkpoint(tmp_path, "c")
    (tmp_path / "c").mkdir()  # a folder, but not a checkpoint
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match=r"c is not a complete dsfunc checkpoint.* Complete checkpoints there: 'a', 'b'$"):
        ckpt.find_checkpoint(tmp_path, "c")
