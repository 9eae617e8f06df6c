"""dsfunc.schedules against DeepSpeed's schedule formulas, written out here in plain Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from dsfunc.config import ConfigError
from dsfunc.optim import momentum_schedule_from_config, schedule_from_config
from dsfunc.schedules import (
    lr_range_test,
    one_cycle,
    one_cycle_momentum,
    warmup_cosine_lr,
    warmup_decay_lr,
    warmup_lr,
)


def check(schedule, expected: dict[int, float]) -> None:
    """schedule(t) is a float32 0-d tensor within one float32 ulp of the Python value, at every t."""
    for t, want in expected.items():
        got = schedule(torch.tensor(t, dtype=torch.int64))
        assert got.dtype == torch.float32 and got.shape == (), t
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1.2e-7, atol=0,
                                   msg=lambda m, t=t: f"t={t}: {m}")


def points(n: int, *late: int) -> list[int]:
    return sorted({-1, 0, 1, n - 1, n, n + 1, *late})


# --------------------------------------------------------------------------------- reference formulas (Python)

def gamma(t: int, n: int, kind: str) -> float:
    n = max(2, n)
    return math.log(t + 1) / math.log(n) if kind == "log" else t / n


def ref_warmup(t, lo, hi, n, kind):
    if t < 0:
        return lo  # what the constructor writes
    return lo + (hi - lo) * (gamma(t, n, kind) if t < max(2, n) else 1.0)


def ref_warmup_decay(t, total, lo, hi, n, kind):
    if t < 0:
        return lo
    n2 = max(2, n)
    g = gamma(t, n, kind) if t < n2 else max(0.0, (total - t) / max(1.0, total - n2))
    return lo + (hi - lo) * g


def ref_warmup_cosine(t, total, wmr, n, cmr, kind, base):
    if t < 0:
        return 0.0
    n2 = max(2, n)
    if t < n2:
        return base * (wmr + (1 - wmr) * gamma(t, n, kind))
    p = min(1.0, (t - n2 + 1) / max(1, total - n2))
    return base * max(0.0, cmr + (1 - cmr) * (1 + math.cos(math.pi * p)) / 2)


def cycle_fraction(t, first, second, first_stairs, second_stairs):
    """Where t sits in the triangle (0 at the ends, 1 at the peak), from the integer position in the cycle."""
    total = first + second
    c = (t + 1) % total
    if c <= first:
        frac, stairs = c / first, first_stairs
    else:
        frac, stairs = (total - c) / second, second_stairs
    return math.floor(frac * stairs) / stairs if stairs > 0 else frac


def ref_one_cycle_lr(t, lo, hi, first, second=None, first_stairs=0, second_stairs=None, decay_rate=0.0,
                     decay_step_size=0):
    second = first if second is None else second
    second_stairs = first_stairs if second_stairs is None else second_stairs
    if t < first + second:
        return lo + (hi - lo) * cycle_fraction(t, first, second, first_stairs, second_stairs)
    if decay_rate == 0 or decay_step_size == 0:
        return lo
    return lo / (1 + decay_rate * (t - (first + second) + 1) / decay_step_size)


def ref_one_cycle_mom(t, lo, hi, first, second=None, decay_rate=0.0, decay_step_size=0):
    second = first if second is None else second
    if t < 0:
        return lo  # the constructor writes the minimum momentum
    if t < first + second:
        return hi - (hi - lo) * cycle_fraction(t, first, second, 0, 0)
    if decay_rate == 0 or decay_step_size == 0:
        return hi
    return hi * (1 + decay_rate * (t - (first + second) + 1) / decay_step_size)


def ref_range_test(t, lo, size, rate, staircase):
    i = (t + 1) / size
    return lo * (1 + rate * (math.floor(i) if staircase else i))


# --------------------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n", [1, 2, 10, 1000])
def test_warmup_lr(kind, n):
    s = warmup_lr(warmup_min_lr=1e-4, warmup_max_lr=3e-2, warmup_num_steps=n, warmup_type=kind)
    check(s, {t: ref_warmup(t, 1e-4, 3e-2, n, kind) for t in points(n, 5 * n + 7)})


def test_warmup_lr_max_none_means_optimizer_lr_and_defaults():
    s = warmup_lr(base_lr=0.5)  # DeepSpeed defaults: min 0, N 1000, log
    check(s, {t: ref_warmup(t, 0.0, 0.5, 1000, "log") for t in points(1000, 20000)})
    with pytest.raises(ValueError, match="warmup_max_lr is None.*base_lr"):
        warmup_lr()


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n,total", [(10, 50), (1, 7), (20, 10)])
def test_warmup_decay_lr(kind, n, total):
    s = warmup_decay_lr(total, warmup_min_lr=2e-3, warmup_max_lr=2e-2, warmup_num_steps=n, warmup_type=kind)
    check(s, {t: ref_warmup_decay(t, total, 2e-3, 2e-2, n, kind)
              for t in points(n, total - 1, total, total + 1, 3 * total)})


def test_warmup_decay_lr_default_max_is_0_001():
    check(warmup_decay_lr(100, warmup_num_steps=10, base_lr=0.5),
          {t: ref_warmup_decay(t, 100, 0.0, 0.001, 10, "log") for t in points(10, 50)})
    check(warmup_decay_lr(100, warmup_max_lr=None, warmup_num_steps=10, base_lr=0.5),
          {t: ref_warmup_decay(t, 100, 0.0, 0.5, 10, "log") for t in points(10, 50)})


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("wmr,cmr", [(0.0, 0.0001), (0.1, 0.05)])
@pytest.mark.parametrize("n,total", [(10, 100), (5, 5), (8, 3)])
def test_warmup_cosine_lr(kind, wmr, cmr, n, total):
    s = warmup_cosine_lr(total, warmup_min_ratio=wmr, warmup_num_steps=n, cos_min_ratio=cmr, warmup_type=kind,
                         base_lr=0.3)
    check(s, {t: ref_warmup_cosine(t, total, wmr, n, cmr, kind, 0.3)
              for t in points(n, total // 2, total - 1, total, total + 1, 4 * total + 13)})


@pytest.mark.parametrize("first,second", [(10, None), (3, 5), (7, 2)])
def test_one_cycle_continuous(first, second):
    s = one_cycle(1e-3, 1e-1, cycle_first_step_size=first, cycle_second_step_size=second)
    total = first + (second or first)
    ts = sorted({-1, 0, 1, first - 1, first, first + 1, total - 1, total, total + 1, 10 * total})
    check(s, {t: ref_one_cycle_lr(t, 1e-3, 1e-1, first, second) for t in ts})
    assert s(torch.tensor(first - 1)).item() == pytest.approx(1e-1)  # the peak is reached


@pytest.mark.parametrize("first,second,first_stairs,second_stairs",
                         [(8, None, 4, None), (6, 9, 3, 0), (6, 9, 0, 3), (10, 5, 3, 2)])
def test_one_cycle_staircase(first, second, first_stairs, second_stairs):
    s = one_cycle(0.01, 0.05, cycle_first_step_size=first, cycle_second_step_size=second,
                  cycle_first_stair_count=first_stairs, cycle_second_stair_count=second_stairs)
    total = first + (second or first)
    check(s, {t: ref_one_cycle_lr(t, 0.01, 0.05, first, second, first_stairs, second_stairs)
              for t in range(-1, total + 3)})
    values = [s(torch.tensor(t)).item() for t in range(-1, total)]
    assert len(set(values)) < len(values) - 2  # flat stairs, not a ramp


def test_one_cycle_decay_phase():
    kw = {"cycle_first_step_size": 4, "decay_lr_rate": 0.5, "decay_step_size": 3}
    s = one_cycle(0.01, 0.1, **kw)
    check(s, {t: ref_one_cycle_lr(t, 0.01, 0.1, 4, decay_rate=0.5, decay_step_size=3)
              for t in [6, 7, 8, 9, 10, 11, 100]})
    assert s(torch.tensor(100)).item() < 0.01 / 10
    for no_decay in ({"decay_lr_rate": 0.5}, {"decay_step_size": 3}):  # either 0 keeps cycle_min_lr
        check(one_cycle(0.01, 0.1, cycle_first_step_size=4, **no_decay), {8: 0.01, 9: 0.01, 500: 0.01})


def test_one_cycle_momentum():
    m = one_cycle_momentum(cycle_first_step_size=5, cycle_second_step_size=3, cycle_min_mom=0.85,
                           cycle_max_mom=0.95)
    check(m, {t: ref_one_cycle_mom(t, 0.85, 0.95, 5, 3) for t in range(-1, 12)})
    assert m(torch.tensor(-1)).item() == pytest.approx(0.85) and m(torch.tensor(0)).item() < 0.95
    d = one_cycle_momentum(cycle_first_step_size=2, decay_step_size=2, decay_mom_rate=0.05)
    check(d, {t: ref_one_cycle_mom(t, 0.8, 0.9, 2, decay_rate=0.05, decay_step_size=2) for t in range(-1, 10)})


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    s = lr_range_test(lr_range_test_min_lr=1e-4, lr_range_test_step_size=5, lr_range_test_step_rate=2.0,
                      lr_range_test_staircase=staircase)
    check(s, {t: ref_range_test(t, 1e-4, 5, 2.0, staircase) for t in [-1, 0, 1, 3, 4, 5, 6, 9, 10, 1234]})
    check(lr_range_test(), {t: ref_range_test(t, 1e-3, 2000, 1.0, False) for t in [-1, 0, 1999, 50000]})


def test_schedule_from_config_uses_deepspeed_names_and_defaults():
    cases = [
        ("WarmupLR", {"warmup_num_steps": 10}, lambda t: ref_warmup(t, 0.0, 0.02, 10, "log")),
        ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 10,
                      "warmup_type": "linear", "last_batch_iteration": -1},
         lambda t: ref_warmup(t, 0.001, 0.05, 10, "linear")),
        ("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 10},
         lambda t: ref_warmup_decay(t, 40, 0.0, 0.001, 10, "log")),
        ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 10},
         lambda t: ref_warmup_cosine(t, 40, 0.0, 10, 0.0001, "log", 0.02)),
        ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 6,
                      "cycle_momentum": True, "cycle_min_mom": 0.8},
         lambda t: ref_one_cycle_lr(t, 0.001, 0.01, 6)),
        ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True},
         lambda t: ref_range_test(t, 1e-3, 3, 1.0, True)),
    ]
    for kind, params, ref in cases:
        check(schedule_from_config(kind, params, base_lr=0.02), {t: ref(t) for t in points(10, 60)})


def test_momentum_schedule_from_config():
    m = momentum_schedule_from_config("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                                   "cycle_first_step_size": 4})
    check(m, {t: ref_one_cycle_mom(t, 0.8, 0.9, 4) for t in range(-1, 10)})
    assert momentum_schedule_from_config("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                                      "cycle_momentum": False}) is None
    assert momentum_schedule_from_config("WarmupLR", {}) is None


def test_config_errors_name_the_problem():
    # a raw section is validated by the config's one table of DeepSpeed keys
    with pytest.raises(ConfigError, match=r'scheduler.type = "Cosine": .*not supported.*"WarmupCosineLR"'):
        schedule_from_config("Cosine", {}, 0.1)
    with pytest.raises(ConfigError, match=r'"scheduler.params.warmup_steps".*"scheduler.params.warmup_num_steps"'):
        schedule_from_config("WarmupLR", {"warmup_steps": 10}, 0.1)
    with pytest.raises(ConfigError, match=r'total_num_steps is required for scheduler "WarmupDecayLR"'):
        schedule_from_config("WarmupDecayLR", {}, 0.1)
    with pytest.raises(ConfigError, match=r'cycle_min_lr is required for scheduler "OneCycle"'):
        schedule_from_config("OneCycle", {}, 0.1)
    with pytest.raises(ConfigError, match="last_batch_iteration = 5 is not supported.*load_checkpoint"):
        schedule_from_config("WarmupLR", {"last_batch_iteration": 5}, 0.1)
    with pytest.raises(ConfigError, match=r'warmup_type = "cosine" is invalid: expected one of "log", "linear"'):
        schedule_from_config("WarmupLR", {"warmup_type": "cosine"}, 0.1)
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
        warmup_cosine_lr(10, warmup_num_steps=0, base_lr=0.1)
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 2.5"):
        warmup_lr(0.0, 1.0, warmup_num_steps=2.5)
    with pytest.raises(ValueError, match="cycle_first_step_size must be > 0"):
        one_cycle(0.1, 1.0, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="lr_range_test_step_size must be > 0"):
        lr_range_test(lr_range_test_step_size=0)


def test_schedules_stay_on_device_without_host_reads():
    t = torch.tensor(3, dtype=torch.int64, device="meta")  # no values: any host read would raise
    for s in (warmup_lr(0.0, 1.0, 10), warmup_decay_lr(20), warmup_cosine_lr(20, base_lr=1.0),
              one_cycle(0.1, 1.0, cycle_first_stair_count=2, decay_lr_rate=0.1, decay_step_size=2),
              one_cycle_momentum(decay_mom_rate=0.1, decay_step_size=2), lr_range_test(lr_range_test_staircase=True)):
        out = s(t)
        assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == ()
