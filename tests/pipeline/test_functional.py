"""A pipelined ``train_step`` (init_state(pipeline=...) or a config "pipeline" section) gives the losses and
parameters of the same model trained in one process: 2 stages on 2 ranks (1F1B with clipping over all stages
and an lr schedule, GPipe, activation checkpointing, bf16, fp16 with its loss scale), and 2 stages x 2 replicas on 4 ranks at ZeRO
1, 2 and 3; a batch of the wrong size is an error naming the sizes."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

import dsfunc
from dsfunc.cli import export as cli_export
from dsfunc.pipeline import StageModule
from tests.multiprocess import run_world
from tests.pipeline import workers


def _close(run, ref, loss_tol, param_tol):
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) < loss_tol
    assert sorted(run["final"]) == sorted(ref["final"])
    for name, value in ref["final"].items():
        assert (run["final"][name] - value).abs().max() < param_tol, name


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline") / "ckpt")


@pytest.fixture(scope="module")
def two_stages(folder):
    return run_world(workers.two_stages, 2, folder)


@pytest.mark.parametrize("case", ["1f1b", "gpipe", "remat"])
def test_two_stages_train_like_one_process(two_stages, case):
    run = two_stages[0][case]
    assert all(torch.equal(run["final"][k], two_stages[1][case]["final"][k]) for k in run["final"])  # one model
    ref = workers.train_reference(run["init"], workers.config(), 1)
    _close(run, ref, 1e-5, 1e-5)
    assert any((run["final"][k] != run["init"][k]).any() for k in run["init"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_pipeline_follows_16_bit_in_one_process(two_stages, precision):
    run = two_stages[0][precision]
    cfg = workers.config(bf16=True) if precision == "bf16" else workers.config(
        fp16={"enabled": True, "initial_scale_power": 8})
    ref = workers.train_reference(run["init"], cfg, 1)
    _close(run, ref, 2e-2, 2e-2)  # 16-bit rounding in a different order (each stage's own compute copies)


def test_a_batch_that_is_not_micro_batches_is_named(two_stages):
    message = two_stages[0]["bad_batch"]
    assert "6 samples" in message and "gradient_accumulation_steps (4)" in message


def test_a_stage_is_refused_the_whole_model_compile_scope(two_stages):
    assert 'compile.scope "model" with pipeline parallelism' in two_stages[0]["whole_model_compile"]
    assert 'use compile.scope "units"' in two_stages[1]["whole_model_compile"]


def test_two_stages_by_two_replicas_at_zero_1_2_3_and_a_resumed_checkpoint(two_stages, folder):
    results = run_world(workers.two_by_two, 4, folder)
    for zero in (1, 2, 3):
        run = results[0][zero]
        ref = workers.train_reference(run["init"], workers.config(micro=2 * workers.MICRO), 2)
        _close(run, ref, 1e-5, 1e-5)
        for other in results[1:]:
            assert all(torch.equal(run["final"][k], other[zero]["final"][k]) for k in run["final"])
    expected = two_stages[0]["ckpt"]["losses"]  # the 2-rank run, uninterrupted
    for rank in range(4):  # resumed at 2 x 2 (ZeRO 3) and at 4 stages
        for case in ("resumed", "four_stages"):
            assert max(abs(a - b) for a, b in zip(results[rank][case], expected)) < 1e-5, (rank, case)


def test_a_pipelined_checkpoint_is_the_whole_model(two_stages, folder, tmp_path):
    saved = two_stages[0]["ckpt"]["saved"]
    assert cli_export([folder, str(tmp_path / "w.safetensors"), "--tag", "half"]) == 0
    exported = safetensors.torch.load_file(str(tmp_path / "w.safetensors"))
    model = StageModule(workers.layers(), partition_method="uniform")
    model.load_state_dict(exported)  # every parameter of the one-stage model, once
    assert sorted(exported) == sorted(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)
    # and it resumes in one process, without a pipeline
    state = dsfunc.init_state(model, workers.config(), loss_fn=lambda m, b: workers.loss_fn(m(b[0]), b[1]))
    losses = workers.resume(state, folder, 1, 0)
    assert max(abs(a - b) for a, b in zip(losses, two_stages[0]["ckpt"]["losses"])) < 1e-5


def test_interleaved_1f1b_holds_two_stages_per_rank_and_trains_like_one_process(tmp_path):
    results = run_world(workers.interleaved, 2, str(tmp_path / "ckpt"))
    assert [r["held"] for r in results] == [[0, 2], [1, 3]]
    run = results[0]
    _close(run, workers.train_reference(run["init"], workers.config(), 1), 1e-5, 1e-5)
    assert cli_export([str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors")]) == 0  # the whole model, in order
    exported = safetensors.torch.load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in run["final"].items()) and exported.keys() == run["final"].keys()
