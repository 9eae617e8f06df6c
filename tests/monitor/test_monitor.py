"""Progress lines, CSV/TensorBoard events, timings, the start-up summary and memory estimate."""

from __future__ import annotations

import csv
import logging
import re
import sys

import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.deepspeed import initialize
from dsfunc.monitor import Monitor, startup_summary, tokens_in
from dsfunc.zero import memory_estimate
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5,
                                          "warmup_type": "linear"}}


def read_csv(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def functional_run(cfg: dict, steps: int, **monitor_kwargs):
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), cfg)
    lines: list[str] = []
    monitor = Monitor(state, write=lines.append, **monitor_kwargs)
    seen = []
    for batch in mlp_batches(steps, cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]):
        state = dsfunc.train_step(state, batch)
        seen.append(state.metrics.to_dict())
        monitor.log(state, batch)
    monitor.close()
    return state, lines, seen


def test_csv_files_hold_every_step_with_samples_on_the_x_axis(tmp_path):
    cfg = config(micro=2, gas=2, scheduler=WARMUP, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                                               "job_name": "run1"})
    _, _, seen = functional_run(cfg, 7)
    lr = read_csv(tmp_path / "run1" / "Train_Samples_lr.csv")
    loss = read_csv(tmp_path / "run1" / "Train_Samples_train_loss.csv")
    assert lr[0] == ["step", "lr"] and loss[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in lr[1:]] == [4 * k for k in range(1, 8)]  # train_batch_size 4
    # WarmupLR linear: the k-th step uses 0.01 * (k - 1) / 5, capped at 0.01
    assert [float(r[1]) for r in lr[1:]] == pytest.approx([0.0, 0.0, 0.002, 0.004, 0.006, 0.008, 0.01])
    assert [float(r[1]) for r in loss[1:]] == pytest.approx([m["loss"] for m in seen], rel=1e-6)
    assert not (tmp_path / "run1" / "Train_Samples_loss_scale.csv").exists()  # fp16 only


def test_progress_lines_every_steps_per_print_with_the_right_values(caplog):
    cfg = config(micro=2, scheduler=WARMUP, steps_per_print=3, wall_clock_breakdown=True)
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), cfg)
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="dsfunc"):
        monitor = Monitor(state, write=lambda text: lines.extend(text.splitlines()))
    assert "ZeRO stage 0 over 1 rank(s)" in lines[0] and "model states per rank" in lines[1]
    logged = [r.getMessage() for r in caplog.records if r.name == "dsfunc"]  # the whole config: logged, not printed
    assert logged[0].startswith("[dsfunc] effective config: {") and '"steps_per_print": 3' in logged[0]
    del lines[:2]
    seen = {}
    for batch in mlp_batches(7, 2):
        state = dsfunc.train_step(state, batch)
        seen[int(state.step)] = state.metrics.to_dict()
        monitor.log(state, batch, timings={"forward": 1.0, "backward": 2.0, "step": 0.5})
    progress = [line for line in lines if " step=" in line]
    assert [int(re.search(r"step=(\d+)", line).group(1)) for line in progress] == [3, 6]
    for line in progress:
        step = int(re.search(r"step=(\d+)", line).group(1))
        assert f"loss={seen[step]['loss']:.4f}," in line
        assert f"lr=[{seen[step]['lr']:.6g}]" in line
        assert "skipped=0," in line and "loss_scale=1," in line and re.search(r"CurrSamplesPerSec=[\d.]+", line)
        assert re.search(r"RSS=[\d.]+GB, MaxRSS=[\d.]+GB", line)
        assert "TokensPerSec" not in line  # float features, no token ids
    assert "RunningAvgSamplesPerSec" in progress[1]  # the running average starts after step 2
    timing = [line for line in lines if "time (ms)" in line]
    assert timing == ["[dsfunc] time (ms) | forward: 1.00 | backward: 2.00 | step: 0.50"] * 2
    with pytest.raises(ValueError, match="same step \\(7\\) twice"):
        monitor.log(state)
    with pytest.raises(ValueError, match="unknown timer 'optimizer'"):
        monitor.log(dsfunc.train_step(state, mlp_batches(1, 2)[0]), timings={"optimizer": 1.0})


def test_engine_progress_skipped_steps_and_loss_scale_events(tmp_path, capsys):
    cfg = config(micro=2, steps_per_print=2, fp16={"enabled": True, "initial_scale_power": 127, "hysteresis": 1},
                 csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "fp16"},
                 wall_clock_breakdown=True)
    torch.manual_seed(0)
    engine, *_ = initialize(model=MLP(), config=cfg)
    x, y = mlp_batches(1, 2)[0]
    for _ in range(4):
        engine.backward(engine(x, y))
        engine.step()
    engine.monitor.flush()
    # 2**127 overflows fp16 gradients: the scale halves each step until the gradients fit
    assert engine.skipped_steps == 4 and not engine.was_step_applied()
    scale = read_csv(tmp_path / "fp16" / "Train_Samples_loss_scale.csv")
    assert scale[0] == ["step", "loss_scale"]
    assert [float(r[1]) for r in scale[1:]] == [2.0**127, 2.0**126, 2.0**125, 2.0**124]
    forward = read_csv(tmp_path / "fp16" / "Train_Samples_elapsed_time_ms_forward.csv")
    assert [int(r[0]) for r in forward[1:]] == [2, 4, 6, 8] and all(float(r[1]) > 0 for r in forward[1:])
    out = capsys.readouterr().out
    assert "[dsfunc] step=2, skipped=2," in out and "[dsfunc] step=4, skipped=4," in out
    assert re.search(r"time \(ms\) \| forward: [\d.]+ \| backward: [\d.]+ \| step: [\d.]+", out)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.out = nn.Linear(8, 11)

    def forward(self, ids):
        logits = self.out(self.emb(ids[:, :-1]))
        return nn.functional.cross_entropy(logits.reshape(-1, 11), ids[:, 1:].reshape(-1))


def test_tokens_per_second_when_the_batch_has_token_ids():
    assert tokens_in((torch.zeros(4, 7, dtype=torch.long), torch.zeros(4))) == 28
    assert tokens_in((torch.zeros(4, 6), torch.zeros(4, dtype=torch.long))) == 0
    lines: list[str] = []
    state = dsfunc.init_state(TinyLM(), config(micro=2, steps_per_print=1))
    monitor = Monitor(state, write=lines.append)
    state = dsfunc.train_step(state, torch.randint(0, 11, (2, 9)))
    monitor.log(state, torch.randint(0, 11, (2, 9)))
    assert re.search(r"TokensPerSec=[\d.]+", lines[-1])


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(micro=2, scheduler=WARMUP, tensorboard={"enabled": True, "output_path": str(tmp_path),
                                                         "job_name": "tb"})
    _, _, seen = functional_run(cfg, 3)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [2, 4, 6]
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in seen], rel=1e-6)
    assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx([0.0, 0.0, 0.002])


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = config(micro=2, tensorboard={"enabled": True, "output_path": str(tmp_path)})
    state = dsfunc.init_state(MLP(), cfg)
    with pytest.raises(ImportError, match="`pip install tensorboard`.*or set tensorboard.enabled to false"):
        Monitor(state)


def test_progress_bar(capsys):
    pytest.importorskip("tqdm")
    _, lines, _ = functional_run(config(micro=2, steps_per_print=None), 3, progress_bar=True, total_steps=3)
    err = capsys.readouterr().err
    assert "3/3" in err and "loss=" in err and lines == []


def test_progress_bar_without_tqdm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match="progress_bar=True needs tqdm"):
        Monitor(dsfunc.init_state(MLP(), config(micro=2)), progress_bar=True)


def estimates(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        cfg = config(micro=2, world=world, stage=stage)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        state = dsfunc.init_state(MLP(width=10, depth=3), cfg)
        out[stage] = memory_estimate(state)
        out[f"summary{stage}"] = startup_summary(state)
    return out


def test_memory_estimate_follows_the_zero_stage():
    world = 2
    per_rank = run_world(estimates, world)
    plan = dsfunc.init_state(MLP(width=10, depth=3), config(micro=2, stage=3)).program.plan
    psi = sum(u.numel for u in plan.units)
    shard = sum(-(-u.numel // world) for u in plan.units)
    blocks = sorted((-(-u.numel // world) * world for u in plan.units if u.module), reverse=True)
    root = next(-(-u.numel // world) * world for u in plan.units if not u.module)
    for est in per_rank:
        assert est[0]["master"] == 4 * psi and est[0]["optimizer"] == 8 * psi and est[0]["compute"] == 0
        assert est[0]["gradients"] == 4 * psi
        for stage in (1, 2, 3):
            assert est[stage]["master"] == 4 * shard and est[stage]["optimizer"] == 8 * shard
        assert est[1]["gradients"] == 4 * psi and est[2]["gradients"] == est[3]["gradients"] == 4 * shard
        assert est[1]["compute"] == est[2]["compute"] == 4 * sum(-(-u.numel // world) * world for u in plan.units)
        assert est[3]["compute"] == 4 * (root + sum(blocks[:2]))
        assert est[3]["total"] < est[2]["total"] < est[1]["total"] < est[0]["total"]
        assert f"{psi:,} trainable parameters" in est["summary3"] and "ZeRO stage 3 over 2 rank(s)" in est["summary3"]


def test_progress_every_10_steps_by_default_as_deepspeed_and_none_when_off():
    """steps_per_print defaults to DeepSpeed's 10: two start-up lines, then one line per 10 steps (the first one
    after the model FLOPs line)."""
    for cfg, expected in ((config(micro=2), [10, 20]), (config(micro=2, steps_per_print=None), [])):
        state = dsfunc.init_state(MLP(), cfg)
        assert state.program.config.steps_per_print == (10 if expected else None)
        written: list[str] = []
        monitor = Monitor(state, write=written.append)
        for batch in mlp_batches(25, 2):
            state = dsfunc.train_step(state, batch)
            monitor.log(state, batch)
        monitor.close()
        lines = "\n".join(written).splitlines()
        assert [int(re.search(r" step=(\d+),", line).group(1)) for line in lines if " step=" in line] == expected
        assert len(lines) == (3 + len(expected) if expected else 0)
        assert not expected or lines[2].startswith("[dsfunc] model FLOPs per sample: ")
