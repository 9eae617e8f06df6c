"""Engine checkpoints in one process: partial loads, client state, the loader position, argument errors."""

from __future__ import annotations

import argparse

import optree
import pytest
import torch
from torch.utils.data import TensorDataset

import dsfunc
from dsfunc.deepspeed import initialize
from dsfunc.optim import ScheduleState
from tests.checkpoint.tampering import Payload, read_index, write_index
from tests.models import MLP, config, mlp_batches, relative_diff

WARMUP = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}


def trained_engine(steps: int, **kwargs):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 6), torch.randint(0, 4, (24,)))
    engine, *_ = initialize(model=MLP(), config=config(micro=2, gas=2, scheduler=WARMUP), training_data=data, **kwargs)
    while engine.global_steps < steps:
        x, y = next(iter(engine.training_dataloader))
        engine.backward(engine(x, y))
        engine.step()
    return engine


def schedule_count(state) -> int:
    nodes = optree.tree_leaves(state.opt_state, is_leaf=lambda x: isinstance(x, ScheduleState))
    return int(next(n for n in nodes if isinstance(n, ScheduleState)).count)


def moments(state) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(state.opt_state) if t.dim() > 0]


@pytest.fixture
def saved(tmp_path):
    engine = trained_engine(3)
    engine.save_checkpoint(str(tmp_path), tag="mine", client_state={"epoch": 1})
    return tmp_path, dsfunc.full_params(engine.state), [m.clone() for m in moments(engine.state)], engine


def test_full_load_restores_everything_and_moves_the_loader(saved):
    path, params, saved_moments, original = saved
    engine = trained_engine(0)
    load_path, client = engine.load_checkpoint(str(path), tag="mine")
    assert load_path == str(path / "mine") and client == {"epoch": 1}
    assert relative_diff(dsfunc.full_params(engine.state), params) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(moments(engine.state), saved_moments))
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (3, 6, 12)
    assert engine.training_dataloader.position == original.training_dataloader.position == 6
    assert engine.get_lr() == original.get_lr()


def test_load_module_only(saved):
    path, params, _, _ = saved
    engine = trained_engine(0)
    engine.load_checkpoint(str(path), tag="mine", load_module_only=True)
    assert relative_diff(dsfunc.full_params(engine.state), params) == 0.0
    assert engine.global_steps == 0 and schedule_count(engine.state) == 0
    assert all(not m.any() for m in moments(engine.state))
    assert engine.training_dataloader.position == 0


def test_fresh_optimizer_keeps_the_loaded_schedule_and_vice_versa(saved):
    path, params, saved_moments, _ = saved
    engine = trained_engine(0)
    engine.load_checkpoint(str(path), tag="mine", load_optimizer_states=False)
    assert relative_diff(dsfunc.full_params(engine.state), params) == 0.0
    assert engine.global_steps == 3 and schedule_count(engine.state) == 3
    assert all(not m.any() for m in moments(engine.state))
    engine = trained_engine(0)
    engine.load_checkpoint(str(path), tag="mine", load_lr_scheduler_states=False)
    assert schedule_count(engine.state) == 0 and engine.global_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(moments(engine.state), saved_moments))
    x, y = mlp_batches(1, 2)[0]
    for _ in range(2):  # it trains on from there
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 4


def test_load_checkpoint_without_a_checkpoint_returns_none(tmp_path, caplog):
    engine, *_ = initialize(model=MLP(), config=config(micro=2))
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    assert "no `latest` file in" in caplog.text and "skip checkpoint load" in caplog.text
    assert engine.load_checkpoint(str(tmp_path), tag="global_step9") == (None, None)
    assert "no checkpoint tagged 'global_step9'" in caplog.text


def test_save_checkpoint_argument_errors(tmp_path):
    engine, *_ = initialize(model=MLP(), config=config(micro=2, gas=2))
    with pytest.raises(ValueError, match="client_state= or client_sd=, not both"):
        engine.save_checkpoint(str(tmp_path), client_state={}, client_sd={})
    with pytest.raises(ValueError, match="'dsfunc_engine' is reserved"):
        engine.save_checkpoint(str(tmp_path), client_state={"dsfunc_engine": 1})
    x, y = mlp_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    with pytest.raises(RuntimeError, match="middle of an optimizer step \\(micro-batch 2 of 2\\)"):
        engine.save_checkpoint(str(tmp_path))
    with pytest.raises(RuntimeError, match="load_checkpoint in the middle of an optimizer step"):
        engine.load_checkpoint(str(tmp_path))


def test_load_module_only_from_a_run_with_another_optimizer(saved):
    path, params, _, _ = saved
    cfg = config(micro=2, gas=2)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    torch.manual_seed(1)
    engine, *_ = initialize(model=MLP(), config=cfg)
    _, client = engine.load_checkpoint(str(path), tag="mine", load_module_only=True)
    assert client == {"epoch": 1}
    assert relative_diff(dsfunc.full_params(engine.state), params) == 0.0 and engine.global_steps == 0
    x, y = mlp_batches(1, 2)[0]
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 1


def test_the_engine_resumes_a_deepspeed_checkpoint(tmp_path):
    """The DeepSpeed script's own resume line: ``engine.load_checkpoint(ds_save_dir)``."""
    from tests.checkpoint.deepspeed.common import CLIENT, RESUMED, SAVE_AT, Case, Net, batch, extract

    case = Case(2, 1, "bf16")
    save_dir = extract(tmp_path) / case.name
    engine, *_ = initialize(model=Net(), config=case.config())
    load_path, client = engine.load_checkpoint(str(save_dir))
    assert load_path == str(save_dir / "global_step3") and client.keys() == CLIENT.keys()
    assert (engine.global_steps, engine.global_samples) == (SAVE_AT, SAVE_AT * 8)
    losses = []
    for step in range(SAVE_AT, SAVE_AT + RESUMED):
        loss = engine(*batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(engine.state.metrics.loss.item())
    reference = torch.load(save_dir / "reference.pt")
    assert max(abs(a - b) / b for a, b in zip(losses, reference["losses"])) < 1e-5
    params = dsfunc.full_params(engine.state)
    assert relative_diff({k: params[k] for k in reference["params"]}, reference["params"]) < 1e-5
    assert engine.global_steps == reference["global_steps"]


def test_resumes_after_a_save_over_its_tag_died_between_the_two_renames(saved):
    """A save over ``mine`` killed after moving the old folder aside and before moving the new one in leaves the
    complete old checkpoint in ``.mine.replaced`` and no ``mine`` (issue 13): the engine resumes from it, as
    dsfunc.load_checkpoint does, instead of warning and starting over from step 0."""
    path, params, saved_moments, original = saved
    (path / "latest").write_text("mine")
    (path / "mine").rename(path / ".mine.replaced")
    (path / ".mine.tmp-0123456789ab").mkdir()  # the new save's folder, never completed
    engine = trained_engine(0)
    load_path, client = engine.load_checkpoint(str(path))
    assert load_path == str(path / ".mine.replaced") and client == {"epoch": 1}
    assert relative_diff(dsfunc.full_params(engine.state), params) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(moments(engine.state), saved_moments))
    assert engine.global_steps == 3 and engine.get_lr() == original.get_lr()


def test_client_state_beyond_plain_data_needs_trust_pickle(tmp_path):
    engine = trained_engine(1)
    engine.save_checkpoint(str(tmp_path), client_state={"args": argparse.Namespace(lr=0.1)})
    fresh = trained_engine(0)
    with pytest.raises(dsfunc.CheckpointError, match="argparse.Namespace.*trust_pickle=True"):
        fresh.load_checkpoint(str(tmp_path))
    _, client = fresh.load_checkpoint(str(tmp_path), trust_pickle=True)
    assert client == {"args": argparse.Namespace(lr=0.1)} and fresh.global_steps == 1


def test_a_tampered_index_is_refused_and_runs_no_code(saved, tmp_path):
    """DCP's .metadata rewritten (manifest too) to run code when unpickled: the engine's load refuses it."""
    path = saved[0]
    index = read_index(path / "mine")
    index.planner_data = Payload(tmp_path / "marker")
    write_index(path / "mine", index)
    engine = trained_engine(0)
    with pytest.raises(dsfunc.CheckpointError, match=r"\.metadata holds an object of class posix\.system"):
        engine.load_checkpoint(str(path), tag="mine")
    assert not (tmp_path / "marker").exists() and engine.global_steps == 0
