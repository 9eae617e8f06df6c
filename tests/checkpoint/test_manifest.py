"""The manifest (``files`` in dsfunc_checkpoint.json) must list every file a load reads, under plain file
names, and each is read only as a regular file of the checkpoint folder: a file left out of the manifest, a
name that leaves the folder, a link, a FIFO or a device is refused (by load_checkpoint and export alike)
before anything of it is read."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.tampering import Payload
from tests.models import MLP, config


def _saved(root: Path, seed: int = 0, tag: str = "t") -> Path:
    torch.manual_seed(seed)
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), root, tag=tag, client_state={"seed": seed})
    return root / tag


def _edit_manifest(folder: Path, edit: Callable[[dict], None]) -> None:
    meta = json.loads((folder / ckpt.META_FILE).read_text())
    edit(meta["files"])
    (folder / ckpt.META_FILE).write_text(json.dumps(meta))


READERS = {
    "load": lambda folder, **kw: ckpt.load_checkpoint(folder, dsfunc.init_state(MLP(), config()), **kw),
    "export": lambda folder, **kw: ckpt.export_fp32(folder, folder.parent / "w.safetensors", **kw),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_shard_left_out_of_the_manifest_is_refused_though_its_bytes_changed(tmp_path, reader):
    folder = _saved(tmp_path)
    shard = folder / "__0_0.distcp"
    _edit_manifest(folder, lambda files: files.pop(shard.name))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: without the manifest's check, another state loads
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorruptError,
                       match=r"damaged: its manifest \(`files` in dsfunc_checkpoint.json\) does not list "
                             r"__0_0.distcp, which .metadata names as holding tensors \(no tensor was read\)"):
        READERS[reader](folder)


@pytest.mark.parametrize("reader", READERS)
def test_an_empty_manifest_with_another_runs_files_is_refused(tmp_path, reader):
    folder, other = _saved(tmp_path / "mine"), _saved(tmp_path / "other", seed=1)
    for name in (".metadata", "__0_0.distcp", "client_state.pt"):
        shutil.copy(other / name, folder / name)
    _edit_manifest(folder, lambda files: files.clear())
    with pytest.raises(ckpt.CheckpointCorruptError,
                       match=r"json is damaged: files does not list .metadata or client_state.pt, which a load reads"):
        READERS[reader](folder)


def test_a_client_state_left_out_of_the_manifest_is_refused_not_empty(tmp_path):
    folder = _saved(tmp_path)
    _edit_manifest(folder, lambda files: files.pop("client_state.pt"))
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"json is damaged: files does not list client_state.pt, which a load reads"):
        READERS["load"](folder)


@pytest.mark.parametrize("reader", READERS)
def test_an_index_left_out_of_the_manifest_is_refused_before_it_is_unpickled(tmp_path, reader):
    """Even trusted: the manifest decides what is read, the trust what unpickling may run."""
    folder = _saved(tmp_path)
    marker = tmp_path / "marker"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _edit_manifest(folder, lambda files: files.pop(".metadata"))
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"json is damaged: files does not list .metadata, which a load reads"):
        READERS[reader](folder, trust_pickle=True)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["/etc/hostname", "../t2/__0_0.distcp", "sub/x", "..", ""])
def test_a_manifest_name_that_leaves_the_folder_is_refused(tmp_path, name):
    folder = _saved(tmp_path)
    _saved(tmp_path, tag="t2")
    _edit_manifest(folder, lambda files: files.update({name: {"bytes": 1, "sha256": "0" * 64}}))
    for reader in READERS.values():
        with pytest.raises(ckpt.CheckpointCorruptError,
                           match=rf"dsfunc_checkpoint.json is damaged: files\[{re.escape(repr(name))}\] is not the plain name"):
            reader(folder)


def _link_out(folder: Path, name: str) -> str:
    (folder / name).unlink()
    (folder / name).symlink_to("/proc/self/pagemap")  # a regular file of /proc that never ends
    return rf"{name} is a symbolic link \(to '/proc/self/pagemap'\), not a regular file"


def _link_in(folder: Path, name: str) -> str:
    (folder / "copy").write_bytes((folder / name).read_bytes())
    (folder / name).unlink()
    (folder / name).symlink_to("copy")
    return rf"{name} is a symbolic link \(to 'copy'\), not a regular file"


def _fifo(folder: Path, name: str) -> str:
    (folder / name).unlink()
    os.mkfifo(folder / name)  # no writer: opening it to read would wait forever
    return rf"{name} is a FIFO, not a regular file"


def _directory(folder: Path, name: str) -> str:
    (folder / name).unlink()
    (folder / name).mkdir()
    return rf"{name} is a directory, not a regular file"


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("make", [_link_out, _link_in, _fifo, _directory])
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "client_state.pt"])
def test_a_listed_file_that_is_not_a_regular_file_is_refused(tmp_path, name, make, verify):
    folder = _saved(tmp_path)
    expected = make(folder, name)
    for reader in READERS.values():
        with pytest.raises(ckpt.CheckpointCorruptError, match=rf"checkpoint {folder} is damaged: {expected}"):
            reader(folder, verify=verify)


def test_a_metadata_file_that_is_a_link_or_fifo_is_refused(tmp_path):
    folder = _saved(tmp_path)
    meta = folder / ckpt.META_FILE
    meta.rename(folder / "meta.json")
    meta.symlink_to("meta.json")
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"dsfunc_checkpoint.json is a symbolic link .*not a regular"):
        READERS["load"](folder)
    meta.unlink()
    os.mkfifo(meta)
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"dsfunc_checkpoint.json is a FIFO, not a regular file"):
        READERS["export"](folder)
