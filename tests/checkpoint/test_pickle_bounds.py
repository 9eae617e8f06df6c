"""Crafted checkpoint pickles that cost unbounded memory, time or stack though they name only allowed
globals: refused before any byte is unpickled, with an error naming the file, on every rank; legitimate
pickles still load. Each attack reads a real crafted file in a child with a limited address space
(:mod:`tests.checkpoint.bounded`): before the bounds, it allocated 16 GiB or more, hung or crashed."""

from __future__ import annotations

import codecs
import io
import pickle
import re
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc.checkpoint.pickle_bounds import MAX_DEPTH, check_pickle, check_tensor
from tests.checkpoint.bounded import read_limited
from tests.checkpoint.tampering import (
    MEMO_INDEX,
    Call,
    append_record,
    dag_key,
    deep_key,
    read_index,
    rewrite,
    torch_file,
    torch_saved,
    write_index,
)
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

KEY = "params/root"  # a tensor every checkpoint of MLP has


def _refused(file: str, what: str) -> str:
    return rf"CheckpointCorruptError: {re.escape(file)}.* holds a pickle that {what}"


def _saved(root: Path, client_state: object = None) -> Path:
    torch.manual_seed(0)
    state = dsfunc.train_step(dsfunc.init_state(MLP(), config()), mlp_batches(1, 4)[0])
    dsfunc.save_checkpoint(state, root / "run", tag="t", client_state=client_state or {"epoch": 1})
    return root / "run"


def _encode_chain(stages: int) -> Call:
    """``_codecs.encode`` applied ``stages`` times with hex (each doubles the bytes), from latin1 text."""
    value = Call(codecs.encode, "x" * 64, "latin1")
    for _ in range(stages):
        value = Call(codecs.encode, value, "hex_codec")
    return value


INDEX_ATTACKS = {  # .metadata of 9 bytes, ~200 bytes and 3 MB
    "memo index": (MEMO_INDEX, r"stores an object under memo index 2147483647 when only 0 are stored"),
    "dag key": (dag_key(40), r"holds dict keys or set items whose parts are shared so often"),
    "deep key": (deep_key(3_000_000), rf"nests objects more than {MAX_DEPTH} deep"),
}


@pytest.mark.parametrize("attack", INDEX_ATTACKS)
def test_a_crafted_index_is_refused_before_it_is_unpickled(tmp_path, attack):
    run = _saved(tmp_path)
    data, what = INDEX_ATTACKS[attack]
    rewrite(run / "t" / ".metadata", data)
    outcome = read_limited("load", str(run))
    assert re.match(_refused(f"{run}/t/.metadata", what), outcome), outcome


CLIENT_ATTACKS = {  # client_state.pt of a few hundred bytes
    "bytearray": (Call(bytearray, 1 << 34), r"asks bytearray/_codecs.encode for more bytes than 2 per byte"),
    "encode chain": (_encode_chain(40), r"calls _codecs.encode with arguments torch.save never writes"),
    "tensor from a size": (Call(torch.FloatTensor, 1 << 34), r"constructs torch.FloatTensor from arguments"),
}


@pytest.mark.parametrize("attack", CLIENT_ATTACKS)
def test_a_client_state_that_allocates_is_refused(tmp_path, attack):
    run = _saved(tmp_path)
    payload, what = CLIENT_ATTACKS[attack]
    rewrite(run / "t" / "client_state.pt", torch_saved({"epoch": payload}))
    outcome = read_limited("load", str(run))
    assert re.match(_refused(f"{run}/t/client_state.pt (data.pkl)", what), outcome), outcome


def test_a_tensor_record_is_bounded_too(tmp_path):
    """DCP's tensor records are unpickled by DCP (weights-only): each is checked first."""
    run = _saved(tmp_path)
    folder = run / "t"
    index = read_index(folder)
    offset, length = append_record(folder, "__0_0.distcp", torch_saved(Call(bytearray, 1 << 34)))
    key = next(k for k in index.storage_data if k.fqn == KEY)
    index.storage_data[key] = type(index.storage_data[key])("__0_0.distcp", offset, length)
    write_index(folder, index)
    outcome = read_limited("export", str(run), str(tmp_path / "w.safetensors"))
    file = f"{folder}/__0_0.distcp (bytes {offset}-{offset + length}) (data.pkl)"
    assert re.search(re.escape(file) + " holds a pickle that asks bytearray", outcome), outcome
    assert not (tmp_path / "w.safetensors").exists()


def _load_dag_client(rank: int, world: int, root: str) -> str:
    state = dsfunc.init_state(MLP(), config(micro=4 // world, world=world, stage=1))
    dsfunc.save_checkpoint(state, root, tag="t")
    if rank == 0:
        rewrite(Path(root) / "t" / "client_state.pt", torch_file(dag_key(40)))
    torch.distributed.barrier()
    try:
        dsfunc.load_checkpoint(root, state, timeout=60)
    except dsfunc.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_every_rank_refuses_a_dag_key_instead_of_hanging(tmp_path):
    """Before the bounds, the rank reading the key hashed it for hours and the other waited for it."""
    errors = run_world(_load_dag_client, 2, str(tmp_path))
    assert errors[0] == errors[1], errors
    assert re.match(_refused(f"{tmp_path}/t/client_state.pt (data.pkl)", "holds dict keys"), errors[0]), errors


def test_what_torch_save_writes_still_loads(tmp_path):
    """Bytes (``_codecs.encode`` in latin1), bytearrays, sets, tuple keys, shared values and tensors pass."""
    shared = {"lr": [0.1] * 100}
    client = {"b": bytes(range(256)) * 40, "ba": bytearray(b"\x00\xff" * 500), "s": {1, 2, (3, 4)},
              "k": {(1, ("a", 2.0)): "v", (5,): 6}, "shared": [shared, shared, shared],
              "t": torch.arange(6.0).reshape(2, 3), "n": [[[[[]]]]] * 3}
    run = _saved(tmp_path, client)
    _, loaded = dsfunc.load_checkpoint(run, dsfunc.init_state(MLP(), config()))
    assert loaded.keys() == client.keys() and all(loaded[k] == v for k, v in client.items() if k != "t")
    assert torch.equal(loaded["t"], client["t"])


def test_an_old_torch_format_is_refused_untrusted_and_read_trusted(tmp_path):
    run = _saved(tmp_path)
    buffer = io.BytesIO()
    torch.save({"epoch": 4}, buffer, _use_new_zipfile_serialization=False)
    rewrite(run / "t" / "client_state.pt", buffer.getvalue())
    with pytest.raises(dsfunc.CheckpointError, match=r"client_state\.pt is in torch's file format before 1\.6"):
        dsfunc.load_checkpoint(run, dsfunc.init_state(MLP(), config()))
    _, client = dsfunc.load_checkpoint(run, dsfunc.init_state(MLP(), config()), trust_pickle=True)
    assert client == {"epoch": 4}


def _check(data: bytes) -> None:
    check_pickle(io.BytesIO(data), "crafted.pkl", len(data))


def test_the_bounds_are_each_needed():
    """Below each bound a pickle passes; the same shape past it is refused."""
    _check(pickle.dumps({1: 2}))
    _check(b"\x80\x04N" + b"r\x00\x00\x00\x00" + b".")  # memo index 0 of 0 stored: the next one
    with pytest.raises(dsfunc.CheckpointError, match="memo index 1 when only 0"):
        _check(b"\x80\x04N" + b"r\x01\x00\x00\x00" + b".")
    _check(deep_key(MAX_DEPTH - 2))  # the empty tuple, the key around it, the dict: MAX_DEPTH levels
    with pytest.raises(dsfunc.CheckpointError, match="nests objects more than"):
        _check(deep_key(MAX_DEPTH - 1))
    _check(dag_key(8))  # 256 steps to hash, within 8 per byte of ~60 bytes plus slack
    with pytest.raises(dsfunc.CheckpointError, match="shared so often"):
        _check(dag_key(20))
    cycle: list = []
    cycle.append([cycle])  # a list inside a list inside the first: filled after it was placed
    with pytest.raises(dsfunc.CheckpointError, match="after placing it inside another"):
        _check(pickle.dumps(cycle))
    with pytest.raises(dsfunc.CheckpointError, match="not a readable pickle"):
        _check(b"\x80\x04not a pickle")


def test_an_expanded_tensor_is_not_copied():
    with pytest.raises(dsfunc.CheckpointError, match=r"repeat the 4 bytes of its storage"):
        check_tensor(torch.zeros(1).expand(1 << 40), "f.pt")
    view = torch.arange(10.0)[2:5]
    assert check_tensor(view, "f.pt") is view


def test_an_index_naming_a_transform_is_refused(tmp_path):
    """A transform (a decompression DCP applies while reading) could inflate a record without bound."""
    run = _saved(tmp_path)
    index = read_index(run / "t")
    key = next(k for k in index.storage_data if k.fqn == KEY)
    index.storage_data[key].transform_descriptors = ["zstd"]
    write_index(run / "t", index)
    with pytest.raises(dsfunc.CheckpointError, match=rf"{KEY} is stored through the transforms \['zstd'\]"):
        dsfunc.checkpoint.export_fp32(run, tmp_path / "w.safetensors")
