"""Learning-rate schedules as pure functions of DeepSpeed's step counter.

A :data:`Schedule` maps ``t`` -- DeepSpeed's ``last_batch_iteration``, an int64 0-d tensor -- to the learning rate as
a float32 0-d tensor on the same device (float64 for a float64 ``t``: the exact value DeepSpeed reports). It is
computed with torch ops only (float64, cast at the end), so it never reads a value back to the host and can run
inside a captured step.

Counting convention (the same as DeepSpeed's engine):

* A DeepSpeed scheduler starts at ``t = -1``, and its constructor already writes ``schedule(-1)`` into the optimizer
  (``warmup_min_lr`` for WarmupLR/WarmupDecayLR, ``0.0`` for WarmupCosineLR, ``cycle_min_lr`` for OneCycle,
  ``lr_range_test_min_lr`` for LRRangeTest).
* The engine steps the scheduler *after* each applied optimizer step, and not at all after a step skipped for
  overflow.
* So the ``k``-th applied optimizer step (``k = 0, 1, ...``) uses ``schedule(k - 1)``:
  :func:`dsfunc.optim.scale_by_learning_rate` evaluates ``schedule(count - 1)``, where ``count`` is the number of
  steps applied before this one.

The factories take DeepSpeed's parameter names and defaults (``deepspeed/runtime/lr_schedules.py``);
:func:`dsfunc.optim.from_config.schedule_from_config` builds one from a ``scheduler`` config section. Unlike DeepSpeed, an unknown
``warmup_type`` is an error instead of a warning that falls back to ``"log"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from dsfunc.errors import InputError

Schedule = Callable[[Tensor], Tensor]
"""``t`` (int64 0-d tensor, DeepSpeed's last_batch_iteration, may be -1) -> lr (float32 0-d tensor)."""

WARMUP_TYPES = ("log", "linear")


def _in_f64(schedule: Schedule) -> Schedule:
    """``schedule`` (written for a float64 ``t``) evaluated in float64, as DeepSpeed's Python floats are, its value
    rounded to the float32 the step uses unless ``t`` came in float64: the engine's ``get_lr()`` reports DeepSpeed's
    value exactly (scripts compare it with the config's numbers)."""

    def evaluated(t: Tensor) -> Tensor:
        lr = schedule(t.to(torch.float64))
        return lr if t.dtype == torch.float64 else lr.to(torch.float32)

    return evaluated


def _warmup_steps(warmup_num_steps: int, where: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise InputError(f"{where}: warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    return max(2, warmup_num_steps)  # DeepSpeed clamps to 2 so that log(N) > 0


def _check_warmup_type(warmup_type: str, where: str) -> None:
    if warmup_type not in WARMUP_TYPES:
        raise InputError(f"{where}: warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")


def _check_total_steps(total_num_steps: int, where: str) -> None:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 0:
        raise InputError(f"{where}: total_num_steps must be a non-negative integer, got {total_num_steps!r}")


def _max_lr(warmup_max_lr: float | None, base_lr: float | None, where: str) -> float:
    if warmup_max_lr is not None:
        return float(warmup_max_lr)
    if base_lr is None:
        raise InputError(f"{where}: warmup_max_lr is None, which means 'the optimizer's lr', but no base_lr was "
                         f"given; pass base_lr=<optimizer lr> or set warmup_max_lr")
    return float(base_lr)


def _warmup_gamma(t: Tensor, n: int, warmup_type: str) -> Tensor:
    """Warmup progress in [0, 1) for ``0 <= t < n``: log(t+1)/log(n) or t/n."""
    if warmup_type == "log":
        return (1.0 / math.log(n)) * torch.log(t + 1)
    return t / n


def warmup_lr(warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
              warmup_type: str = "log", *, base_lr: float | None = None) -> Schedule:
    """DeepSpeed ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then constant.

    ``lr(t) = min + (max - min) * gamma``, ``gamma = log(t+1)/log(N)`` (``"log"``) or ``t/N`` (``"linear"``) for
    ``t < N = max(2, warmup_num_steps)``, else 1; ``lr(-1) = warmup_min_lr``. ``warmup_max_lr=None`` means the
    optimizer's lr, given as ``base_lr``.

    >>> s = warmup_lr(0.0, 0.1, warmup_num_steps=10, warmup_type="linear")
    >>> float(s(torch.tensor(5)))
    0.05000000074505806
    """
    where = "WarmupLR"
    n = _warmup_steps(warmup_num_steps, where)
    _check_warmup_type(warmup_type, where)
    min_lr = float(warmup_min_lr)
    delta = _max_lr(warmup_max_lr, base_lr, where) - min_lr

    @_in_f64
    def schedule(t: Tensor) -> Tensor:
        gamma = torch.where(t < n, _warmup_gamma(t, n, warmup_type), 1.0)
        return torch.where(t < 0, min_lr, min_lr + delta * gamma)

    return schedule


def warmup_decay_lr(total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = 0.001,
                    warmup_num_steps: int = 1000, warmup_type: str = "log", *,
                    base_lr: float | None = None) -> Schedule:
    """DeepSpeed ``WarmupDecayLR``: :func:`warmup_lr`, then linear decay to 0 at ``total_num_steps``.

    After warmup ``gamma = max(0, (T - t) / max(1, T - N))``. Note DeepSpeed's default ``warmup_max_lr`` here is
    0.001 (not the optimizer lr); ``None`` means the optimizer's lr, given as ``base_lr``.
    """
    where = "WarmupDecayLR"
    _check_total_steps(total_num_steps, where)
    n = _warmup_steps(warmup_num_steps, where)
    _check_warmup_type(warmup_type, where)
    min_lr = float(warmup_min_lr)
    delta = _max_lr(warmup_max_lr, base_lr, where) - min_lr
    decay_span = float(max(1.0, total_num_steps - n))

    @_in_f64
    def schedule(t: Tensor) -> Tensor:
        decay = ((total_num_steps - t) / decay_span).clamp_min(0.0)
        gamma = torch.where(t < n, _warmup_gamma(t, n, warmup_type), decay)
        return torch.where(t < 0, min_lr, min_lr + delta * gamma)

    return schedule


def warmup_cosine_lr(total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                     cos_min_ratio: float = 0.0001, warmup_type: str = "log", *, base_lr: float) -> Schedule:
    """DeepSpeed ``WarmupCosineLR``: a ratio of the optimizer's lr (``base_lr``), warmup then cosine decay.

    Warmup (``0 <= t < N``): ``ratio = warmup_min_ratio + gamma * (1 - warmup_min_ratio)``. After:
    ``p = min(1, (t - N + 1) / max(1, T - N))``, ``ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) *
    (1 + cos(pi p)) / 2)``. ``lr(-1) = 0``.
    """
    where = "WarmupCosineLR"
    _check_total_steps(total_num_steps, where)
    n = _warmup_steps(warmup_num_steps, where)
    _check_warmup_type(warmup_type, where)
    wmr, cmr, base = float(warmup_min_ratio), float(cos_min_ratio), float(base_lr)
    cos_span = max(1, total_num_steps - n)

    @_in_f64
    def schedule(t: Tensor) -> Tensor:
        warm = wmr + _warmup_gamma(t, n, warmup_type) * (1.0 - wmr)
        progress = ((t - n + 1) / cos_span).clamp_max(1.0)
        cosine = (cmr + (1.0 - cmr) * ((1 + torch.cos(math.pi * progress)) / 2)).clamp_min(0.0)
        ratio = torch.where(t < n, warm, cosine)
        return torch.where(t < 0, 0.0, base * ratio)

    return schedule


class _CycleShape:
    """The triangular cycle of DeepSpeed's OneCycle, shared by its lr and momentum schedules."""

    def __init__(self, first_step_size: float, second_step_size: float | None, first_stair_count: int,
                 second_stair_count: int | None, decay_step_size: float):
        if not first_step_size > 0:
            raise InputError(f"OneCycle: cycle_first_step_size must be > 0, got {first_step_size!r}")
        if second_step_size is not None and not second_step_size > 0:
            raise InputError(f"OneCycle: cycle_second_step_size must be > 0 (or null = first), "
                             f"got {second_step_size!r}")
        for name, count in (("cycle_first_stair_count", first_stair_count),
                            ("cycle_second_stair_count", second_stair_count)):
            if count is not None and count < 0:
                raise InputError(f"OneCycle: {name} must be >= 0 (0 = no staircase), got {count!r}")
        if decay_step_size < 0:
            raise InputError(f"OneCycle: decay_step_size must be >= 0 (0 = no decay), got {decay_step_size!r}")
        self.first = float(first_step_size)
        self.second = float(second_step_size) if second_step_size is not None else self.first
        self.total = self.first + self.second
        self.ratio = self.first / self.total
        self.first_stairs = first_stair_count
        self.second_stairs = first_stair_count if second_stair_count is None else second_stair_count
        self.decay_step_size = decay_step_size

    def scale(self, t: Tensor) -> Tensor:
        """Position in the cycle: 0 at its ends, 1 at the peak (floored to stairs when a stair count is set)."""
        it = t + 1
        cycle = torch.floor(1 + it / self.total)
        x = 1.0 + it / self.total - cycle
        up = x <= self.ratio
        scale = torch.where(up, x / self.ratio, (x - 1) / (self.ratio - 1))
        if self.first_stairs == 0 and self.second_stairs == 0:
            return scale
        stairs = torch.where(up, float(self.first_stairs), float(self.second_stairs))
        in_cycle = torch.remainder(it, self.total)
        position = torch.where(in_cycle <= self.first, in_cycle * stairs / self.first,
                               (self.total - in_cycle) * stairs / self.second)
        return torch.where(stairs > 0, torch.floor(position) / stairs, scale)

    def decay_interval(self, t: Tensor) -> Tensor:
        return (t - self.total + 1) / self.decay_step_size


def one_cycle(cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
              cycle_first_step_size: float = 2000, cycle_second_step_size: float | None = None,
              cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
              decay_step_size: float = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
              cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0) -> Schedule:
    """DeepSpeed ``OneCycle`` learning rate (the momentum part is :func:`one_cycle_momentum`).

    With ``it = t + 1``, one triangle of ``first + second`` steps: up from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps, down over ``cycle_second_step_size``; a stair count ``> 0`` holds the lr flat on
    that many stairs per half. From ``t >= first + second``: ``cycle_min_lr / (1 + decay_lr_rate * k /
    decay_step_size)`` with ``k = t - (first + second) + 1`` (constant ``cycle_min_lr`` when either is 0).
    The momentum arguments are accepted so that a config's params pass straight through; they do not affect the lr.
    """
    shape = _CycleShape(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                        cycle_second_stair_count, decay_step_size)
    min_lr, height = float(cycle_min_lr), float(cycle_max_lr) - float(cycle_min_lr)
    skip_decay = decay_step_size == 0 or decay_lr_rate == 0

    @_in_f64
    def schedule(t: Tensor) -> Tensor:
        cyc = min_lr + height * shape.scale(t)
        # a tensor numerator: torch computes ``float / tensor`` as a product with the reciprocal, an ulp off
        decayed = torch.full_like(t, min_lr)
        if not skip_decay:
            decayed = decayed / (1 + decay_lr_rate * shape.decay_interval(t))
        return torch.where(t < shape.total, cyc, decayed)

    return schedule


def one_cycle_momentum(cycle_min_lr: float | None = None, cycle_max_lr: float | None = None,
                       decay_lr_rate: float = 0.0, cycle_first_step_size: float = 2000,
                       cycle_second_step_size: float | None = None, cycle_first_stair_count: int = 0,
                       cycle_second_stair_count: int | None = None, decay_step_size: float = 0,
                       cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                       decay_mom_rate: float = 0.0, *, reported: bool = False) -> Schedule:
    """DeepSpeed ``OneCycle`` momentum: the value it writes into ``betas[0]``, as a schedule of ``t``.

    Inverse to the lr: ``cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale`` in the cycle, then
    ``cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size)`` (constant ``cycle_max_mom`` when either is 0).
    ``t = -1`` gives ``cycle_min_mom``: DeepSpeed's constructor writes the *minimum* before the first step, while its
    formula at the cycle start gives the maximum. DeepSpeed also sets ``betas[1] = 0.99`` whenever it cycles
    momentum; :func:`dsfunc.optim.optimizer_from_config` reproduces that. ``cycle_momentum`` is accepted for config
    pass-through; whether to cycle is the caller's choice (see :func:`dsfunc.optim.momentum_schedule_from_config`).
    ``reported=True``: what DeepSpeed's ``get_mom()`` reports instead, the formula's ``cycle_max_mom`` at ``t = -1``.
    """
    shape = _CycleShape(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                        cycle_second_stair_count, decay_step_size)
    max_mom, height = float(cycle_max_mom), float(cycle_max_mom) - float(cycle_min_mom)
    skip_decay = decay_step_size == 0 or decay_mom_rate == 0

    @_in_f64
    def schedule(t: Tensor) -> Tensor:
        cyc = max_mom - height * shape.scale(t)
        decayed = torch.full_like(t, max_mom) if skip_decay else max_mom * (
            1 + decay_mom_rate * shape.decay_interval(t))
        mom = torch.where(t < shape.total, cyc, decayed)
        return mom if reported else torch.where(t < 0, float(cycle_min_mom), mom)

    return schedule


def lr_range_test(lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: float = 2000,
                  lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False) -> Schedule:
    """DeepSpeed ``LRRangeTest``: ``min_lr * (1 + step_rate * i)``, ``i = (t + 1) / step_size`` (floored when
    ``lr_range_test_staircase``)."""
    if not lr_range_test_step_size > 0:
        raise InputError(f"LRRangeTest: lr_range_test_step_size must be > 0, got {lr_range_test_step_size!r}")
    min_lr, rate, size = float(lr_range_test_min_lr), float(lr_range_test_step_rate), lr_range_test_step_size

    @_in_f64
    def schedule(t: Tensor) -> Tensor:
        interval = (t + 1) / size
        if lr_range_test_staircase:
            interval = torch.floor(interval)
        return min_lr * (1 + rate * interval)

    return schedule
