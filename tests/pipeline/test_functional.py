"""A pipelined ``train_step`` (init_state(pipeline=...) or a config "pipeline" section) gives the losses and
parameters of the same model trained in one process: 2 stages on 2 ranks (1F1B with clipping over all stages
and an lr schedule, GPipe, activation checkpointing, bf16), and 2 stages x 2 replicas on 4 ranks at ZeRO
1, 2 and 3; a batch of the wrong size is an error naming the sizes."""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_world
from tests.pipeline import workers


def _close(run, ref, loss_tol, param_tol):
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) < loss_tol
    assert sorted(run["final"]) == sorted(ref["final"])
    for name, value in ref["final"].items():
        assert (run["final"][name] - value).abs().max() < param_tol, name


@pytest.fixture(scope="module")
def two_stages():
    return run_world(workers.two_stages, 2)


@pytest.mark.parametrize("case", ["1f1b", "gpipe", "remat"])
def test_two_stages_train_like_one_process(two_stages, case):
    run = two_stages[0][case]
    assert all(torch.equal(run["final"][k], two_stages[1][case]["final"][k]) for k in run["final"])  # one model
    ref = workers.train_reference(run["init"], workers.config(), 1)
    _close(run, ref, 1e-5, 1e-5)
    assert any((run["final"][k] != run["init"][k]).any() for k in run["init"])


def test_bf16_pipeline_follows_bf16_in_one_process(two_stages):
    run = two_stages[0]["bf16"]
    ref = workers.train_reference(run["init"], workers.config(bf16=True), 1)
    _close(run, ref, 2e-2, 2e-2)  # bf16 rounding of activations that cross a stage boundary differs


def test_a_batch_that_is_not_micro_batches_is_named(two_stages):
    message = two_stages[0]["bad_batch"]
    assert "6 samples" in message and "gradient_accumulation_steps (4)" in message


def test_two_stages_by_two_replicas_at_zero_1_2_3():
    results = run_world(workers.two_by_two, 4)
    for zero in (1, 2, 3):
        run = results[0][zero]
        ref = workers.train_reference(run["init"], workers.config(micro=2 * workers.MICRO), 2)
        _close(run, ref, 1e-5, 1e-5)
        for other in results[1:]:
            assert all(torch.equal(run["final"][k], other[zero]["final"][k]) for k in run["final"])
