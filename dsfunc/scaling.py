"""DeepSpeed's fp16 loss scaler as a pure value: a frozen config (:class:`LossScaler`) and a state of 0-d tensors.

:meth:`LossScaler.update` is DeepSpeed's ZeRO ``DynamicLossScaler.update_scale`` written with ``torch.where``, so it
runs on device without a host sync. It is called once per optimizer step, skipped or not::

    if overflow:
        if delayed_shift == 1 or cur_hysteresis == 1:
            (at min_scale with raise_error_at_min_scale: DeepSpeed raises; here ``dead`` is set instead)
            scale = max(scale / 2, min_scale)
        else:
            cur_hysteresis -= 1
        last_overflow_iter = cur_iter
    else:
        if consecutive_hysteresis: cur_hysteresis = delayed_shift
        stable = cur_iter - last_overflow_iter - 1
        if stable > 0 and stable % scale_window == 0:
            if not consecutive_hysteresis: cur_hysteresis = delayed_shift
            scale *= 2
    cur_iter += 1

A static scaler (fp16 ``loss_scale > 0``, or :meth:`LossScaler.none` for bf16/fp32) never changes its scale; the
step still skips overflowing updates. The step checks ``dead`` on the host when it suits it
(:func:`check_not_dead`), which raises :class:`LossScaleError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dsfunc.config import FP16Config
from dsfunc.errors import Error, InputError


class LossScaleError(Error, RuntimeError):
    """The fp16 loss scale is at its minimum and gradients still overflow."""


class LossScaleState(NamedTuple):
    """The loss scaler's state; all 0-d tensors on the training device."""

    scale: Tensor  # float32: multiply the loss by this
    cur_iter: Tensor  # int64: optimizer steps seen (skipped ones included)
    last_overflow_iter: Tensor  # int64: cur_iter of the last overflow, -1 before any
    cur_hysteresis: Tensor  # int64: overflows still tolerated before the scale halves
    dead: Tensor  # bool: overflowed again at min_scale with raise_error_at_min_scale (sticky)


@dataclass(frozen=True)
class LossScaler:
    """Loss-scaling rule (static configuration). Defaults are DeepSpeed's fp16 defaults."""

    dynamic: bool = True
    init_scale: float = 2.0 ** 16
    scale_window: int = 1000
    delayed_shift: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    raise_error_at_min_scale: bool = True

    @property
    def unscaled(self) -> bool:
        """The scale is 1 for good (bf16, fp32, or a static fp16 scale of 1): multiplying or dividing by it can
        be skipped, bit for bit."""
        return not self.dynamic and self.init_scale == 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise InputError(f"loss scale must be a finite number > 0, got {self.init_scale!r}")
        if not self.dynamic:
            return
        if isinstance(self.scale_window, bool) or not isinstance(self.scale_window, int) or self.scale_window <= 0:
            raise InputError(f"fp16.loss_scale_window must be an integer > 0, got {self.scale_window!r}")
        if isinstance(self.delayed_shift, bool) or not isinstance(self.delayed_shift, int) or self.delayed_shift < 1:
            raise InputError(f"fp16.hysteresis must be an integer >= 1, got {self.delayed_shift!r}")
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            raise InputError(f"fp16.min_loss_scale must be a finite number > 0, got {self.min_scale!r}")

    @classmethod
    def none(cls) -> LossScaler:
        """Scale fixed at 1 (bf16 and fp32 training; overflowing steps are still skipped)."""
        return cls(dynamic=False, init_scale=1.0)

    @classmethod
    def static(cls, scale: float) -> LossScaler:
        """A fixed scale (DeepSpeed's ``fp16.loss_scale > 0``)."""
        return cls(dynamic=False, init_scale=float(scale))

    @classmethod
    def from_config(cls, fp16: FP16Config) -> LossScaler:
        """From DeepSpeed's validated ``fp16`` section: disabled gives :meth:`none`, ``loss_scale > 0`` a
        static scale, ``loss_scale == 0`` the dynamic rule with ``2 ** initial_scale_power``,
        ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale`` and
        ``raise_error_at_min_scale``."""
        if not fp16.enabled:
            return cls.none()
        if fp16.loss_scale > 0:
            return cls.static(fp16.loss_scale)
        return cls(dynamic=True, init_scale=2.0 ** fp16.initial_scale_power, scale_window=fp16.loss_scale_window,
                   delayed_shift=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=float(fp16.min_loss_scale), raise_error_at_min_scale=fp16.raise_error_at_min_scale)

    def init(self, device: torch.device | str | None = None) -> LossScaleState:
        """The state before the first step, on ``device``."""

        def full(value: Any, dtype: torch.dtype) -> Tensor:
            return torch.full((), value, dtype=dtype, device=device)

        return LossScaleState(scale=full(self.init_scale, torch.float32), cur_iter=full(0, torch.int64),
                              last_overflow_iter=full(-1, torch.int64),
                              cur_hysteresis=full(self.delayed_shift, torch.int64), dead=full(False, torch.bool))

    def update(self, state: LossScaleState, overflow: Tensor) -> LossScaleState:
        """The state after one optimizer step; ``overflow`` is a bool 0-d tensor (already agreed across ranks)."""
        last_overflow = torch.where(overflow, state.cur_iter, state.last_overflow_iter)
        if not self.dynamic:
            return state._replace(cur_iter=state.cur_iter + 1, last_overflow_iter=last_overflow)

        hysteresis = state.cur_hysteresis
        shift = torch.ones_like(overflow) if self.delayed_shift == 1 else hysteresis == 1
        scale_if_overflow = torch.where(shift, (state.scale / 2).clamp_min(self.min_scale), state.scale)
        hysteresis_if_overflow = torch.where(shift, hysteresis, hysteresis - 1)

        stable = state.cur_iter - state.last_overflow_iter - 1
        grow = (stable > 0) & (torch.remainder(stable, self.scale_window) == 0)
        scale_if_clean = torch.where(grow, state.scale * 2, state.scale)
        refill = torch.full_like(hysteresis, self.delayed_shift)
        hysteresis_if_clean = refill if self.consecutive_hysteresis else torch.where(grow, refill, hysteresis)

        dead = state.dead
        if self.raise_error_at_min_scale:
            dead = dead | (overflow & shift & (state.scale == self.min_scale))
        return LossScaleState(scale=torch.where(overflow, scale_if_overflow, scale_if_clean),
                              cur_iter=state.cur_iter + 1, last_overflow_iter=last_overflow,
                              cur_hysteresis=torch.where(overflow, hysteresis_if_overflow, hysteresis_if_clean),
                              dead=dead)


def check_not_dead(scaler: LossScaler, state: LossScaleState) -> None:
    """Raise :class:`LossScaleError` if the scale reached ``min_loss_scale`` and still overflowed (host sync)."""
    if bool(state.dead):
        raise LossScaleError(
            f"fp16 loss scale is already at min_loss_scale ({scaler.min_scale:g}) and the gradients still "
            f"overflow (inf/nan), so training cannot continue (DeepSpeed stops here as well). Options: train in "
            f"bf16 (\"bf16\": {{\"enabled\": true}}), which needs no loss scaling; set a static \"loss_scale\" in "
            f"the fp16 section; lower \"min_loss_scale\"; or set \"raise_error_at_min_scale\": false in the fp16 "
            f"section to keep skipping overflowing steps.")


class MinScaleCheck:
    """The host's view of a state's ``scaler.dead`` flag, copied without stalling the device.

    On CUDA the flag is copied into pinned memory behind an event; :meth:`raise_if_dead` looks only once
    the event has completed, so the step that asks never waits (a later one reports it: ``dead`` is sticky).
    """

    def __init__(self, dead: Tensor) -> None:
        if dead.device.type == "cuda":
            self.flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.flag.copy_(dead, non_blocking=True)
            self.event: Any = torch.cuda.Event()
            self.event.record()
        else:
            self.flag, self.event = dead.clone(), None

    def raise_if_dead(self, scaler: LossScaler, state: LossScaleState) -> None:
        if self.event is not None and not self.event.query():
            return
        if bool(self.flag):
            check_not_dead(scaler, state)
