"""What a load trusts a checkpoint with: every file is verified, with the ranks agreeing, before anything is
unpickled; the client state is read with weights_only=True unless trust_pickle=True."""

from __future__ import annotations

import argparse
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.checkpoint.trust import TRUST_MODEL
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

ROOT = Path(__file__).resolve().parents[2]


class _WritesMarker:
    """Unpickling this runs code: it creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('code ran')",))


def tamper(path: Path, marker: Path) -> None:
    """Replace ``path`` with a pickle that writes ``marker`` when loaded, padded to the original size."""
    payload = pickle.dumps(_WritesMarker(str(marker)), protocol=2)
    size = path.stat().st_size
    assert len(payload) < size
    path.write_bytes(payload + b"\0" * (size - len(payload)))


def save_tamper_load(rank: int, world: int, root: str, verify: bool) -> str:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), config(micro=4 // world, world=world, stage=1))
    ckpt.save_checkpoint(state, root, tag="t", client_state={"epoch": 3})
    folder = Path(root) / "t"
    if rank == 0:
        tamper(folder / "client_state.pt", Path(root) / "marker")
    torch.distributed.barrier()
    try:
        ckpt.load_checkpoint(root, state, verify=verify, timeout=60)
    except ckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_tampered_client_state_is_an_error_before_any_rank_unpickles_it(tmp_path):
    """On two ranks client_state.pt is in rank 1's share of the checksums: before the fix rank 0 unpickled it
    (and ran its code) before rank 1's verdict arrived."""
    errors = run_world(save_tamper_load, 2, str(tmp_path), True)
    assert not (tmp_path / "marker").exists(), "unpickling the tampered client state ran code"
    for message in errors:
        assert message.startswith("CheckpointCorruptError: ")
        assert "client_state.pt does not match the sha256 recorded when it was written" in message


def test_without_verification_weights_only_still_refuses_to_run_code(tmp_path):
    errors = run_world(save_tamper_load, 2, str(tmp_path), False)
    assert not (tmp_path / "marker").exists(), "unpickling the tampered client state ran code"
    for message in errors:
        assert "client_state.pt holds an object of class exec" in message
        assert "trust_pickle=True" in message


def test_client_state_needing_full_unpickling_names_the_opt_in(tmp_path):
    state = dsfunc.init_state(MLP(), config())
    state = dsfunc.train_step(state, mlp_batches(1, 4)[0])
    plain = {"epoch": 2, "losses": [1.5, 1.25], "best": torch.tensor(0.5), "name": "run", "pair": (1, None)}
    dsfunc.save_checkpoint(state, tmp_path, tag="plain", client_state=plain)
    _, client = dsfunc.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()), tag="plain")
    assert client.keys() == plain.keys() and client["losses"] == [1.5, 1.25] and client["pair"] == (1, None)
    dsfunc.save_checkpoint(state, tmp_path, tag="args", client_state={"args": argparse.Namespace(lr=0.1)})
    template = dsfunc.init_state(MLP(), config())
    with pytest.raises(ckpt.CheckpointError, match="holds an object of class argparse.Namespace") as e:
        dsfunc.load_checkpoint(tmp_path, template, tag="args")
    assert "pass trust_pickle=True" in str(e.value)
    _, client = dsfunc.load_checkpoint(tmp_path, template, tag="args", trust_pickle=True)  # template still usable
    assert client == {"args": argparse.Namespace(lr=0.1)}


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_trust_model_is_one_sentence_everywhere():
    sentence = _words(TRUST_MODEL)
    assert sentence in _words((ROOT / "README.md").read_text())
    assert sentence in _words(dsfunc.load_checkpoint.__doc__)
    helped = subprocess.run([sys.executable, "-m", "dsfunc.cli", "export", "--help"], capture_output=True, text=True,
                            check=True).stdout
    assert sentence in _words(helped)
    assert re.search(r"\.metadata", helped) and "not tampering" in helped
