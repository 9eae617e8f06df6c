"""dsfunc.scaling step by step against a plain-Python transcription of DeepSpeed's ZeRO DynamicLossScaler."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dsfunc.config import Config, FP16Config
from dsfunc.scaling import LossScaleError, LossScaler, LossScaleState, check_not_dead
from tests.cuda_sync import no_host_sync


class Died(Exception):
    pass


class ReferenceScaler:
    """reference/deepspeed.md section 2, line by line, in Python numbers."""

    def __init__(self, init_scale, scale_window, delayed_shift, consecutive_hysteresis, min_scale,
                 raise_error_at_min_scale=True):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_window = scale_window
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise Died()
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2
        self.cur_iter += 1

    def as_tuple(self):
        return (self.cur_scale, self.cur_iter, self.last_overflow_iter, self.cur_hysteresis)


def as_tuple(state: LossScaleState):
    return (state.scale.item(), state.cur_iter.item(), state.last_overflow_iter.item(), state.cur_hysteresis.item())


def run(scaler: LossScaler, overflows) -> list[tuple]:
    state = scaler.init("cpu")
    out = []
    for o in overflows:
        state = scaler.update(state, torch.tensor(bool(o)))
        out.append(as_tuple(state) + (state.dead.item(),))
    return out


def compare(scaler: LossScaler, overflows) -> list[tuple]:
    """Step both; return our trajectory. Where the reference raises, our ``dead`` flag must turn on."""
    ref = ReferenceScaler(scaler.init_scale, scaler.scale_window, scaler.delayed_shift,
                          scaler.consecutive_hysteresis, scaler.min_scale, scaler.raise_error_at_min_scale)
    state = scaler.init("cpu")
    trajectory = []
    for k, o in enumerate(overflows):
        state = scaler.update(state, torch.tensor(bool(o)))
        try:
            ref.update_scale(o)
        except Died:
            assert state.dead.item(), f"step {k}: reference died, dead flag not set"
            return trajectory
        assert as_tuple(state) == ref.as_tuple(), f"step {k} (overflow={o})"
        assert not state.dead.item(), f"step {k}: dead set but the reference lives"
        trajectory.append(as_tuple(state))
    return trajectory


@pytest.mark.parametrize("delayed_shift", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("raise_error", [True, False])
def test_random_sequences_match_reference(delayed_shift, consecutive, raise_error):
    rng = random.Random(delayed_shift * 10 + consecutive * 2 + raise_error)
    scaler = LossScaler(init_scale=2.0 ** 6, scale_window=4, delayed_shift=delayed_shift,
                        consecutive_hysteresis=consecutive, min_scale=2.0, raise_error_at_min_scale=raise_error)
    seen_growth = seen_floor = False
    for trial in range(30):
        p = rng.choice([0.1, 0.3, 0.6])
        trajectory = compare(scaler, [rng.random() < p for _ in range(60)])
        scales = [s[0] for s in trajectory]
        seen_growth |= any(b > a for a, b in itertools.pairwise(scales))
        seen_floor |= 2.0 in scales
    assert seen_growth and seen_floor  # the sequences really exercised growth and the floor


def test_hysteresis_is_consumed_before_halving():
    traj = compare(LossScaler(init_scale=1024.0, scale_window=1000, delayed_shift=3), [1, 1, 1, 1, 0, 1])
    assert [(s, h) for s, _, _, h in traj] == [(1024.0, 2), (1024.0, 1), (512.0, 1), (256.0, 1), (256.0, 1),
                                               (128.0, 1)]


def test_growth_after_window_clean_steps_refills_hysteresis():
    scaler = LossScaler(init_scale=8.0, scale_window=3, delayed_shift=2)
    traj = compare(scaler, [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    assert [s for s, *_ in traj] == [8, 8, 8, 16, 16, 16, 16, 16, 32, 32, 32, 64]
    assert [h for *_, h in traj] == [2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2]  # refilled only when growing
    assert [last for _, _, last, _ in traj][4:] == [4] * 8


def test_consecutive_hysteresis_refills_on_every_clean_step():
    scaler = LossScaler(init_scale=8.0, scale_window=100, delayed_shift=2, consecutive_hysteresis=True)
    traj = compare(scaler, [1, 0, 1, 0, 1, 1])
    assert [(s, h) for s, _, _, h in traj] == [(8, 1), (8, 2), (8, 1), (8, 2), (8, 1), (4, 1)]


def test_floor_at_min_loss_scale_then_dead():
    scaler = LossScaler(init_scale=16.0, scale_window=1000, delayed_shift=1, min_scale=3.0)
    traj = run(scaler, [1, 1, 1, 1, 0, 1])
    assert [s for s, *_ in traj] == [8, 4, 3, 3, 3, 3]
    assert [d for *_, d in traj] == [False, False, False, True, True, True]  # sticky once set
    compare(scaler, [1, 1, 1, 1])  # the reference raises exactly at the 4th overflow


def test_hysteresis_protects_the_minimum_until_exhausted():
    traj = run(LossScaler(init_scale=2.0, delayed_shift=2, min_scale=1.0), [1, 1, 1, 1])
    assert [(s, h, d) for s, _, _, h, d in traj] == [(2, 1, False), (1, 1, False), (1, 1, True), (1, 1, True)]


def test_raise_error_false_keeps_skipping_at_the_floor():
    traj = run(LossScaler(init_scale=4.0, delayed_shift=1, min_scale=1.0, raise_error_at_min_scale=False),
               [1] * 6)
    assert [s for s, *_ in traj] == [2, 1, 1, 1, 1, 1]
    assert not any(d for *_, d in traj)


def test_static_scale_never_changes():
    for scaler in (LossScaler.static(128.0), LossScaler.none()):
        traj = run(scaler, [1, 1, 0, 0, 0, 1, 1, 1] + [0] * 20)
        assert {s for s, *_ in traj} == {scaler.init_scale}
        assert not any(d for *_, d in traj)
    assert LossScaler.none().init().scale.item() == 1.0


def test_check_not_dead_message():
    scaler = LossScaler(init_scale=1.0, delayed_shift=1, min_scale=1.0)
    state = scaler.init()
    check_not_dead(scaler, state)  # alive: no error
    state = scaler.update(state, torch.tensor(True))
    with pytest.raises(LossScaleError) as info:
        check_not_dead(scaler, state)
    message = str(info.value)
    for needle in ("min_loss_scale (1)", "still overflow", "bf16", '"loss_scale"',
                   '"raise_error_at_min_scale": false'):
        assert needle in message
    assert isinstance(info.value, RuntimeError)


def test_from_config():
    assert LossScaler.from_config(FP16Config(enabled=False, loss_scale=0)) == LossScaler.none()
    assert LossScaler.from_config(FP16Config()) == LossScaler.none()
    assert LossScaler.from_config(FP16Config(enabled=True, loss_scale=512)) == LossScaler.static(512.0)
    assert LossScaler.from_config(FP16Config(enabled=True)) == LossScaler(
        dynamic=True, init_scale=65536.0, scale_window=1000, delayed_shift=2, consecutive_hysteresis=False,
        min_scale=1.0, raise_error_at_min_scale=True)
    cfg = FP16Config(enabled=True, loss_scale=0, initial_scale_power=12, loss_scale_window=50, hysteresis=4,
                     consecutive_hysteresis=True, min_loss_scale=0.25, raise_error_at_min_scale=False)
    scaler = LossScaler.from_config(cfg)
    assert scaler == LossScaler(True, 4096.0, 50, 4, True, 0.25, False)
    parsed = Config.load({"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 12,
                                                          "loss_scale_window": 50, "hysteresis": 4,
                                                          "consecutive_hysteresis": True, "min_loss_scale": 0.25,
                                                          "raise_error_at_min_scale": False}})
    assert LossScaler.from_config(parsed.fp16) == scaler
    state = scaler.init()
    assert (state.scale.dtype, state.cur_iter.dtype, state.cur_hysteresis.dtype, state.dead.dtype) == (
        torch.float32, torch.int64, torch.int64, torch.bool)
    assert as_tuple(state) == (4096.0, 0, -1, 4) and not state.dead.item()


def test_bad_values_are_clear_errors():
    with pytest.raises(ValueError, match="loss_scale_window must be an integer > 0"):
        LossScaler(scale_window=0)
    with pytest.raises(ValueError, match="hysteresis must be an integer >= 1"):
        LossScaler(delayed_shift=0)
    with pytest.raises(ValueError, match="min_loss_scale must be a finite number > 0"):
        LossScaler(min_scale=0.0)
    with pytest.raises(ValueError, match="loss scale must be a finite number > 0"):
        LossScaler.static(float("inf"))


def test_update_is_pure_and_never_syncs():
    scaler = LossScaler(init_scale=8.0, scale_window=2, delayed_shift=2)
    state = scaler.init()
    snapshot = tuple(x.clone() for x in state)
    scaler.update(state, torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip(state, snapshot))
    meta = scaler.init("meta")  # meta tensors have no values: a host read or a value branch would raise
    for overflow in (True, False):
        meta = scaler.update(meta, torch.tensor(overflow, device="meta"))
    assert all(x.device.type == "meta" for x in meta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_update_never_syncs():
    scaler = LossScaler(init_scale=8.0, scale_window=2, delayed_shift=2, min_scale=1.0)
    overflows = [1, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    flags = [torch.tensor(bool(o), device="cuda") for o in overflows]
    state = scaler.init("cuda")
    with no_host_sync():  # any device->host read raises
        for flag in flags:
            state = scaler.update(state, flag)
    want = run(scaler, overflows)[-1]
    assert as_tuple(state) + (state.dead.item(),) == want
