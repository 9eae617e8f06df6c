"""Tags and ``latest`` never lead out of the save_dir, and no link or odd name there blocks a save: one tag
rule on save and load, ``latest`` read only as a small regular file naming a tag, links replaced or removed
(never followed) by saves."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.errors import InputError
from tests.checkpoint.common import trained
from tests.models import MLP, config, mlp_batches

BATCHES = mlp_batches(2, 4)


def _template() -> dsfunc.TrainState:
    return dsfunc.init_state(MLP(), config())


def _step_of(root: Path, tag: str | None = None) -> int:
    state, _ = ckpt.load_checkpoint(root, _template(), tag=tag)
    return int(state.step)


@pytest.mark.parametrize("tag, problem", [("best ", "it contains ' '"), (" best", "it contains ' '"),
                                          ("a\tb", "it contains '\\t'"), ("a\nb", "it contains '\\n'"),
                                          ("a\\b", "it contains '\\\\'"), ("x" * 201, "it is 201 bytes long"),
                                          ("ü" * 101, "it is 202 bytes long")])
def test_a_tag_is_checked_by_one_rule_on_save_and_load(tmp_path, tag, problem):
    state = _template()
    ckpt.save_checkpoint(state, tmp_path, tag="best")
    for call in (lambda: ckpt.save_checkpoint(state, tmp_path, tag=tag),
                 lambda: ckpt.load_checkpoint(tmp_path, _template(), tag=tag),
                 lambda: ckpt.find_checkpoint(tmp_path, tag)):
        with pytest.raises(InputError, match=rf"^invalid checkpoint tag .*: {re.escape(problem)}; a tag is the name of a folder"):
            call()
    assert len(ckpt.available_tags(tmp_path)) == 1


@pytest.mark.parametrize("content, problem", [("best \n", "it contains ' '"), ("../other/global_step1", "it starts with '.'"),
                                              ("/abs/global_step1", "it contains '/'"), (".best.replaced", "it starts with '.'")])
def test_latest_naming_anything_but_a_tag_of_its_save_dir_is_refused(tmp_path, content, problem):
    ckpt.save_checkpoint(trained(MLP(), config(), BATCHES, 1), tmp_path / "other")
    ckpt.save_checkpoint(_template(), tmp_path / "run", tag="best")
    (tmp_path / "run" / "latest").write_text(content)
    with pytest.raises(ckpt.CheckpointCorruptError,
                       match=rf"latest names {re.escape(repr(content.strip(chr(10))))}, which is not a tag \({problem}.*pass tag="):
        _step_of(tmp_path / "run")
    (tmp_path / "run" / "latest").write_text("best\n")  # a hand-written line names its tag
    assert _step_of(tmp_path / "run") == 0


def test_latest_is_read_only_as_a_small_regular_file(tmp_path):
    state = _template()
    ckpt.save_checkpoint(state, tmp_path, tag="a")
    latest = tmp_path / "latest"
    latest.unlink()
    latest.symlink_to("/dev/zero")
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"latest is a symbolic link \(to '/dev/zero'\), not a regular"):
        _step_of(tmp_path)
    latest.unlink()
    os.mkfifo(latest)  # no writer: reading it would wait forever
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"latest is a FIFO, not a regular file"):
        _step_of(tmp_path)
    latest.unlink()
    latest.write_text("a" * 100_000)
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"latest holds more than 800 bytes"):
        _step_of(tmp_path)
    latest.unlink()
    latest.symlink_to("/dev/zero")
    ckpt.save_checkpoint(state, tmp_path, tag="b")  # a save replaces the link, never writes through it
    assert not latest.is_symlink() and latest.read_text() == "b" and _step_of(tmp_path) == 0


def test_a_tag_linked_inside_the_save_dir_loads_and_one_linked_outside_is_refused(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    ckpt.save_checkpoint(trained(MLP(), config(), BATCHES, 1), run)
    ckpt.save_checkpoint(trained(MLP(), config(), BATCHES, 2), other)
    (run / "best").symlink_to("global_step1")
    assert _step_of(run, "best") == 1 and "best" in ckpt.available_tags(run)
    (run / "far").symlink_to(other / "global_step2")
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match=rf"far is a symbolic link to {other}/global_step2, outside {run}: a tag names a "
                             "checkpoint of its own save_dir only"):
        _step_of(run, "far")
    (run / "latest").write_text("far")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"far \(named by .*latest\) is a symbolic link"):
        _step_of(run)
    assert "far" not in ckpt.available_tags(run)


def test_saving_over_a_tag_that_is_a_link_replaces_the_link_and_later_saves_work(tmp_path):
    """A user's ``best -> global_step1``: the save under ``best`` publishes, returns, and leaves global_step1."""
    ckpt.save_checkpoint(trained(MLP(), config(), BATCHES, 1), tmp_path)
    (tmp_path / "best").symlink_to("global_step1")
    state = trained(MLP(), config(), BATCHES, 2)
    assert ckpt.save_checkpoint(state, tmp_path, tag="best") == str(tmp_path / "best")
    assert (tmp_path / "best").is_dir() and not (tmp_path / "best").is_symlink()
    assert _step_of(tmp_path, "best") == 2 and _step_of(tmp_path, "global_step1") == 1
    ckpt.save_checkpoint(state, tmp_path, tag="best")
    ckpt.save_checkpoint(state, tmp_path)
    assert ckpt.available_tags(tmp_path) == ["global_step1", "best", "global_step2"]


def test_stale_links_among_a_saves_own_names_are_removed_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    run = tmp_path / "run"
    ckpt.save_checkpoint(_template(), run, tag="a")
    (run / ".a.replaced").symlink_to(outside)  # as if a save over 'a' died between its renames
    (run / ".b.replaced").symlink_to(outside)
    (run / ".c.tmp-0123456789ab").symlink_to(outside)
    (run / ".latest.tmp-0123456789ab").write_text("half")  # a `latest` that was never moved into place
    for _ in range(2):
        ckpt.save_checkpoint(_template(), run, tag="a")
    assert sorted(p.name for p in run.iterdir()) == [".lock", "a", "latest"]
    assert (outside / "keep.txt").read_text() == "mine"


def test_a_file_of_the_users_named_like_the_tag_is_kept_and_named(tmp_path):
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(ckpt.CheckpointError, match=rf"{tmp_path}/notes is a file, not a checkpoint folder: remove"):
        ckpt.save_checkpoint(_template(), tmp_path, tag="notes")
    assert (tmp_path / "notes").read_text() == "mine"
    ckpt.save_checkpoint(_template(), tmp_path, tag="other")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "notes", "other"]
