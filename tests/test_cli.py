"""``dsfunc export``'s argument handling: swapped arguments are named, and nothing is written."""

from __future__ import annotations

import torch

import dsfunc
from dsfunc.cli import export as cli_export
from tests.models import MLP, config


def test_export_notices_swapped_arguments(tmp_path, capsys):
    state = dsfunc.init_state(MLP(), config())
    dsfunc.save_checkpoint(state, tmp_path / "ck")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in ("ck", "ck/global_step0"):  # the save_dir or the checkpoint folder as OUT
        assert cli_export([str(tmp_path / "w.safetensors"), str(tmp_path / out)]) == 1
        err = capsys.readouterr().err
        assert f"OUT {tmp_path / out} is a checkpoint directory; the arguments are CKPT_DIR then OUT" in err
        assert f"did you mean `dsfunc export {tmp_path / out} {tmp_path / 'w.safetensors'}`" in err
    torch.save(dsfunc.full_params(state), tmp_path / "model.pt")  # a weights file where CKPT_DIR goes
    assert cli_export([str(tmp_path / "model.pt"), str(tmp_path / "w.safetensors")]) == 1
    assert "model.pt is a file, not a checkpoint directory" in capsys.readouterr().err
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert after == sorted([*map(str, before), "model.pt"])  # nothing written, nothing removed
    assert cli_export([str(tmp_path / "ck"), str(tmp_path / "w.safetensors")]) == 0  # the right order works
