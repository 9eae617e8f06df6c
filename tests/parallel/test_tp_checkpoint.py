"""A checkpoint of a tensor-parallel state describes the global model: saved at tp 2 x dp 2 after 4 steps, it
loads at tp 1 x dp 4, at sp 2 and in one process with every parameter exactly as saved, and 4 more steps from
there equal the uninterrupted tp 2 x dp 2 run; ``dsfunc export`` writes the full model. AdamW with clipping and
SGD with momentum (the optimizer state, resharded too, drives every later update)."""

from __future__ import annotations

import pytest
import safetensors.torch

import dsfunc
from tests.checkpoint import tp_resume
from tests.multiprocess import run_world
from tests.parallel import tp_runs as runs

pytest.importorskip("transformers")

TOLERANCE = 1e-6  # resumed vs uninterrupted, norm-wise per parameter and per loss


def _saved(tmp_path, optimizer: dict, stage: int) -> dict:
    results = run_world(tp_resume.save_at_tp2, 4, runs.ds_config(optimizer, stage, 2, tp=2), str(tmp_path),
                        timeout=900)
    run = results[0]
    for other in results[1:]:
        assert tp_resume.max_relative(other["params"], run["params"]) == 0
    assert run["resumed_losses"] == run["losses"]  # at the saving mesh: bit for bit
    assert tp_resume.max_relative(run["resumed_params"], run["params"]) == 0
    return run


def _assert_resumed(got: dict, run: dict) -> None:
    assert tp_resume.max_relative(got["loaded"], run["saved"]) == 0  # the checkpoint is the saved model exactly
    for a, b in zip(got["losses"], run["losses"]):
        assert abs(a - b) <= TOLERANCE * abs(b), (got["losses"], run["losses"])
    assert tp_resume.max_relative(got["params"], run["params"]) <= TOLERANCE


def test_tp2xdp2_checkpoint_resumes_at_tp1xdp4_and_in_one_process(tmp_path):
    run = _saved(tmp_path, runs.ADAMW, 1)
    start = runs.llama().state_dict()
    assert tp_resume.max_relative(run["params"], start) > 3e-3  # it trains: a wrong resume would show
    for got in run_world(tp_resume.resume, 4, runs.ds_config(runs.ADAMW, 2, 4), str(tmp_path), timeout=900):
        _assert_resumed(got, run)
    _assert_resumed(tp_resume.resume(0, 1, runs.ds_config(runs.ADAMW, 0, 1), str(tmp_path)), run)
    out = tmp_path / "model.safetensors"
    dsfunc.export_fp32(tmp_path, out)
    exported = safetensors.torch.load_file(out)
    assert exported.keys() == run["saved"].keys()
    assert all((exported[k] == run["saved"][k]).all() for k in exported)


def test_tp2xdp2_checkpoint_resumes_at_sp2_with_sgd(tmp_path):
    run = _saved(tmp_path, runs.SGD, 2)
    config = {**runs.ds_config(runs.SGD, 1, 1), "sequence_parallel_size": 2}
    for got in run_world(tp_resume.resume, 2, config, str(tmp_path), timeout=900):
        _assert_resumed(got, run)


def test_a_flat_checkpoint_into_a_tp_state_is_refused_saying_what_to_do(tmp_path):
    for message in run_world(tp_resume.flat_into_tp, 2, str(tmp_path), timeout=900):
        assert "saved without tensor parallelism" in message and "autotp_size 1" in message
