"""A dsfunc checkpoint whose files were rewritten to run code when unpickled (manifest rewritten to match):
load_checkpoint, export and ``dsfunc export`` refuse each with an error naming the file, and no code runs,
unless trust_pickle=True."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.common import leaves_equal
from tests.checkpoint.tampering import Payload, append_record, read_index, rewrite, torch_saved, write_index
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

ROOT = Path(__file__).resolve().parents[2]
KEY = "params/root"  # a tensor every checkpoint of MLP has, read by load and export alike


def _whole_index(folder: Path, marker: Path) -> str:
    rewrite(folder / ".metadata", pickle.dumps(Payload(marker)))
    return r"\.metadata holds an object of class posix\.system .*pass trust_pickle=True"


def _inside_index(folder: Path, marker: Path) -> str:
    index = read_index(folder)
    index.planner_data = Payload(marker)
    write_index(folder, index)
    return r"\.metadata holds an object of class posix\.system .*pass trust_pickle=True"


def _bytes_entry(folder: Path, marker: Path) -> str:
    """The index calls a tensor pickled bytes, which DCP's planner reads with weights_only=False."""
    index = read_index(folder)
    offset, length = append_record(folder, "__0_0.distcp", torch_saved(Payload(marker)))
    index.state_dict_metadata[KEY] = BytesStorageMetadata()
    index.storage_data[MetadataIndex(KEY)] = _StorageInfo("__0_0.distcp", offset, length)
    write_index(folder, index)
    return rf"\.metadata does not index tensors stored in .*: {KEY} is stored as pickled bytes"


def _tensor_record(folder: Path, marker: Path) -> str:
    index = read_index(folder)
    offset, length = append_record(folder, "__0_0.distcp", torch_saved(Payload(marker)))
    key = next(k for k in index.storage_data if k.fqn == KEY)
    index.storage_data[key] = _StorageInfo("__0_0.distcp", offset, length)
    write_index(folder, index)
    return r"a tensor record of the data files holds an object of class posix\.system, which torch\.load"


def _outside_folder(folder: Path, marker: Path) -> str:
    outside = folder.parent / "elsewhere.distcp"
    outside.write_bytes(torch_saved(Payload(marker)))
    index = read_index(folder)
    key = next(k for k in index.storage_data if k.fqn == KEY)
    index.storage_data[key] = _StorageInfo("../elsewhere.distcp", 0, outside.stat().st_size)
    write_index(folder, index)
    return rf"{KEY} is stored outside the folder"


def _client_state(folder: Path, marker: Path) -> str:
    rewrite(folder / "client_state.pt", torch_saved({"epoch": Payload(marker)}))
    return r"client_state\.pt holds an object of class posix\.system .*pass trust_pickle=True"


VECTORS: dict[str, Callable[[Path, Path], str]] = {
    "whole .metadata": _whole_index, "inside .metadata": _inside_index, "bytes entry": _bytes_entry,
    "tensor record": _tensor_record, "outside the folder": _outside_folder, "client state": _client_state,
}


def _saved(tmp_path: Path) -> tuple[Path, dsfunc.TrainState]:
    torch.manual_seed(0)
    state = dsfunc.train_step(dsfunc.init_state(MLP(), config()), mlp_batches(1, 4)[0])
    dsfunc.save_checkpoint(state, tmp_path / "run", tag="t", client_state={"epoch": 1})
    return tmp_path / "run", state


def _hf_config(tmp_path: Path) -> Path:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    return tmp_path / "hf"


READERS = {
    "load_checkpoint": lambda run, tmp: dsfunc.load_checkpoint(run, dsfunc.init_state(MLP(), config())),
    "export_fp32": lambda run, tmp: ckpt.export_fp32(run, tmp / "w.safetensors"),
    "export_hf": lambda run, tmp: ckpt.export_hf(run, tmp / "out", _hf_config(tmp)),
}


@pytest.mark.parametrize("vector, reader", [(v, r) for v in VECTORS for r in READERS
                                             if v != "client state" or r == "load_checkpoint"])  # export reads none
def test_a_tampered_file_is_refused_and_runs_no_code(tmp_path, vector, reader):
    run, _ = _saved(tmp_path)
    marker = tmp_path / "marker"
    expected = VECTORS[vector](run / "t", marker)
    with pytest.raises(dsfunc.CheckpointError, match=expected):
        READERS[reader](run, tmp_path)
    assert not marker.exists(), f"reading the tampered checkpoint ({vector}) ran its code"
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "out").exists()


def test_the_template_is_untouched_when_the_index_is_refused(tmp_path):
    run, _ = _saved(tmp_path)
    _inside_index(run / "t", tmp_path / "marker")
    template = dsfunc.init_state(MLP(), config())
    with pytest.raises(dsfunc.CheckpointError, match=rf"{run / 't' / '.metadata'} holds"):
        dsfunc.load_checkpoint(run, template)
    assert not template.donated  # refused before any tensor was read: the template can be used again


def test_the_payloads_are_live_and_trust_pickle_lets_them_run(tmp_path):
    """The tests above can fail: a trusted load runs the index's payload, and DCP's own reader runs the
    bytes entry's."""
    run, saved = _saved(tmp_path)
    _inside_index(run / "t", tmp_path / "marker")
    loaded, client = dsfunc.load_checkpoint(run, dsfunc.init_state(MLP(), config()), trust_pickle=True)
    assert (tmp_path / "marker").exists() and leaves_equal(loaded, saved) and client == {"epoch": 1}

    other = tmp_path / "other"
    other.mkdir()
    run, _ = _saved(other)
    _bytes_entry(run / "t", other / "marker")
    targets = {KEY: torch.empty(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's warning that it assumes one process
        dcp.load(targets, storage_reader=dcp.FileSystemReader(str(run / "t")), no_dist=True)
    assert (other / "marker").exists() and targets[KEY] == 0  # os.system's exit status, in place of the tensor


def test_trust_pickle_still_loads_and_exports_a_legitimate_checkpoint(tmp_path):
    run, saved = _saved(tmp_path)
    loaded, client = dsfunc.load_checkpoint(run, dsfunc.init_state(MLP(), config()), trust_pickle=True)
    assert leaves_equal(loaded, saved) and client == {"epoch": 1}
    restricted = ckpt.export_fp32(run, tmp_path / "a.safetensors")
    trusted = ckpt.export_fp32(run, tmp_path / "b.safetensors", trust_pickle=True)
    assert Path(restricted).read_bytes() == Path(trusted).read_bytes()


def test_dsfunc_export_refuses_and_trust_pickle_is_its_flag(tmp_path):
    run, _ = _saved(tmp_path)
    marker = tmp_path / "marker"
    _whole_index(run / "t", marker)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "dsfunc.cli", "export", str(run), str(tmp_path / "w.safetensors")]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert refused.returncode == 1 and not marker.exists()
    assert "holds an object of class posix.system" in refused.stderr and "--trust-pickle" in refused.stderr
    trusted = subprocess.run([*command, "--trust-pickle"], capture_output=True, text=True, env=env, timeout=120,
                             check=False)
    assert trusted.returncode == 1 and marker.exists(), "the flag reaches the reader"
    assert "is not DCP's index of the tensors (it holds a int)" in trusted.stderr


def _load_tampered(rank: int, world: int, root: str) -> str:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), config(micro=4 // world, world=world, stage=2))
    ckpt.save_checkpoint(state, root, tag="t")
    if rank == 0:
        _inside_index(Path(root) / "t", Path(root) / "marker")
    torch.distributed.barrier()
    try:
        ckpt.load_checkpoint(root, state, timeout=60)
    except ckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_every_rank_refuses_a_tampered_index(tmp_path):
    errors = run_world(_load_tampered, 2, str(tmp_path))
    assert not (tmp_path / "marker").exists()
    assert errors[0] == errors[1] and "holds an object of class posix.system" in errors[0]


def test_an_index_that_is_no_pickle_is_named_corrupt(tmp_path):
    run, _ = _saved(tmp_path)
    rewrite(run / "t" / ".metadata", b"\x80\x04not a pickle")
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"\.metadata is not a readable pickle: "):
        ckpt.export_fp32(run, tmp_path / "w.safetensors")
