"""DeepSpeed's client state, crafted: walked once per object (a DAG of lists stays one), never by recursion
(200,000 nested lists are a clear error, also in ``dsfunc export``), copied by the class's method (a
tensor's own state cannot replace what comes back) and never expanded beyond its stored bytes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc.checkpoint.pickle_bounds import MAX_DEPTH
from tests.checkpoint.bounded import ROOT, read_limited
from tests.checkpoint.deepspeed.common import Case, Net
from tests.checkpoint.tampering import add_item, deep_lists, with_data_pkl

CASE = "s1_w1_fp32"
MAIN = Path("global_step3") / "mp_rank_00_model_states.pt"


def _copy(ds_root: Path, tmp_path: Path) -> Path:
    return shutil.copytree(ds_root / CASE, tmp_path / CASE)


def _resave(path: Path, **client) -> None:
    saved = torch.load(path, weights_only=True)
    saved.update(client)
    torch.save(saved, path)


def test_a_dag_of_lists_is_walked_once_per_list(ds_root, tmp_path):
    """40 levels of ``[x, x]``: 2**40 paths, 41 lists (before, the walk copied every path)."""
    save_dir = _copy(ds_root, tmp_path)
    dag: list = []
    for _ in range(40):
        dag = [dag, dag]
    _resave(save_dir / MAIN, dag=dag)
    assert read_limited("load_deepspeed", str(save_dir), "dag") == "loaded depth 40 shared True"


def test_lists_nested_200000_deep_are_a_clear_error_in_dsfunc_export(ds_root, tmp_path):
    save_dir = _copy(ds_root, tmp_path)
    main = save_dir / MAIN
    main.write_bytes(with_data_pkl(main, add_item("deep", deep_lists(200_000))))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "dsfunc.cli", "export", str(save_dir), str(tmp_path / "w.pt")],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert re.fullmatch(rf"dsfunc export: error: {re.escape(str(main))} \(data\.pkl\) holds a pickle that nests "
                        rf"objects more than {MAX_DEPTH} deep .*\n", run.stderr), run.stderr


def _load(save_dir: Path) -> dict:
    case = Case(1, 1, "fp32")
    return dsfunc.load_checkpoint(save_dir, dsfunc.init_state(Net(), case.config(world=1, stage=0)))[1]


def test_a_tensor_whose_state_shadows_clone_comes_back_whole(ds_root, tmp_path):
    save_dir = _copy(ds_root, tmp_path)
    tensor = torch.arange(4.0)
    tensor.clone = torch.Tensor  # pickled as instance state; called, it makes an empty tensor
    _resave(save_dir / MAIN, shadowed=tensor)
    assert torch.equal(_load(save_dir)["shadowed"], torch.arange(4.0))


def test_a_tensor_expanded_beyond_its_storage_is_refused(ds_root, tmp_path):
    save_dir = _copy(ds_root, tmp_path)
    _resave(save_dir / MAIN, expanded=torch.zeros(1).expand(1 << 40))  # 4 bytes stored, 4 TiB copied
    with pytest.raises(dsfunc.CheckpointError, match=rf"{re.escape(str(save_dir / MAIN))} holds a tensor of "
                                                     r"shape \(1099511627776,\) whose"):
        _load(save_dir)
