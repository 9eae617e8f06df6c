"""``checkpoint.tag_validation`` on two real ranks that give different tags: "Fail" raises on every rank (an
AssertionError too, as DeepSpeed's), "Warn" (the default) and "Ignore" save under rank 0's tag, "Warn" saying
so on rank 0; a load with different tags always raises."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.models import MLP, config
from tests.multiprocess import run_world


def _save_with_rank_tags(rank: int, world: int, root: str) -> dict[str, Any]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dsfunc").addHandler(handler)
    seen: dict[str, Any] = {}
    for mode in ("Fail", "Warn", "Ignore", None):
        torch.manual_seed(0)
        extra = {} if mode is None else {"checkpoint": {"tag_validation": mode}}
        state = dsfunc.init_state(MLP(), config(world=world, **extra))
        records.clear()
        try:
            seen[mode] = ckpt.save_checkpoint(state, Path(root) / str(mode), tag=f"tag{rank}", timeout=30)
        except ckpt.CheckpointTagError as e:
            seen[mode] = (type(e).__name__, isinstance(e, AssertionError), str(e))
        seen[f"{mode} said"] = [r.getMessage() for r in records if "checkpoint tags" in r.getMessage()]
    try:
        ckpt.load_checkpoint(Path(root) / "Warn", state, tag=f"tag{rank}", timeout=30)
    except ckpt.CheckpointTagError as e:
        seen["load"] = str(e)
    return seen


def test_tag_validation_modes(tmp_path):
    seen = run_world(_save_with_rank_tags, 2, str(tmp_path))
    for rank in range(2):
        name, is_assertion, message = seen[rank]["Fail"]
        assert name == "CheckpointTagError" and is_assertion
        assert "rank 0: save_checkpoint(tag='tag0'); rank 1: save_checkpoint(tag='tag1')" in message
        for mode in ("Warn", "Ignore", "None"):
            assert seen[rank][None if mode == "None" else mode] == str(tmp_path / mode / "tag0")
            assert ckpt.available_tags(tmp_path / mode) == ["tag0"]
        assert seen[rank]["Ignore said"] == []
        assert "rank 0: load_checkpoint(tag='tag0'); rank 1: load_checkpoint(tag='tag1')" in seen[rank]["load"]
    for mode in ("Warn", None):
        assert seen[1][f"{mode} said"] == []
        [line] = seen[0][f"{mode} said"]
        assert line.startswith("the ranks gave different checkpoint tags (rank 0: save_checkpoint(tag='tag0'); ")
        assert "saving under rank 0's, 'tag0'" in line


@pytest.mark.parametrize("mode", ["fail", "WARN", "Ignore"])
def test_any_case_is_read(mode):
    assert dsfunc.Config.load(config(checkpoint={"tag_validation": mode})).checkpoint.tag_validation == mode.upper()


@pytest.mark.parametrize("mode, enabled, fail", [("Ignore", False, False), ("Warn", True, False), ("FAIL", True, True)])
def test_the_engines_accessors_read_the_mode(mode, enabled, fail):
    engine, *_ = dsfunc.initialize(model=MLP(), config=config(checkpoint={"tag_validation": mode}))
    assert (engine.checkpoint_tag_validation_enabled(), engine.checkpoint_tag_validation_fail()) == (enabled, fail)
