"""The ``fp16``, ``bf16`` and ``data_types`` sections: compute dtype, loss scaling, accumulation and buffer dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import (
    _DTYPE_NAME,
    _NON_NEGATIVE,
    _accepted,
    _bool,
    _choice,
    _integer,
    _number,
    _only,
    _reject,
)
from dsfunc.config.errors import _bad
from dsfunc.config.schema import _key, _parse, _Schema, _Spec


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: fp16 mixed precision and (dynamic) loss scaling."""

    enabled: bool = _key(False, _bool)
    """Run forward and backward in float16, with fp32 master weights and loss scaling."""
    loss_scale: float = _key(0.0, _NON_NEGATIVE)
    """0: dynamic loss scaling (the default); > 0: this fixed scale."""
    initial_scale_power: int = _key(16, _integer(ge=0, le=127))
    """The dynamic scale starts at 2 ** initial_scale_power (at most 127: fp32 holds 2**127)."""
    loss_scale_window: int = _key(1000, _integer())
    """Optimizer steps without an overflow after which the dynamic scale doubles (>= 1 where the scale is dynamic;
    unused otherwise, and then not checked, as DeepSpeed)."""
    hysteresis: int = _key(2, _integer(ge=1))
    """Overflowing steps tolerated before the dynamic scale halves (DeepSpeed's delayed shift); applied at
    every ZeRO stage, where DeepSpeed's non-ZeRO fp16 path ignores it.
    """
    consecutive_hysteresis: bool = _key(False, _bool)
    """Refill the hysteresis on every step without an overflow (so only consecutive overflows count); false
    refills it only when the scale grows.
    """
    min_loss_scale: float = _key(1.0, _number())
    """The dynamic scale never goes below this (> 0 where the scale is dynamic; unused otherwise, and then not
    checked, as DeepSpeed)."""
    auto_cast: bool = _key(False, _bool)
    """Parsed and kept, not read: dsfunc always casts the floating-point inputs of the forwards a step runs to
    the compute dtype, where DeepSpeed casts them to fp16 only when this is true.
    """
    raise_error_at_min_scale: bool = _key(True, _bool)
    """A dsfunc key (DeepSpeed's loss scaler takes it, its config does not): true stops the run with
    LossScaleError when a step overflows at min_loss_scale; false keeps skipping such steps.
    """

    def __post_init__(self) -> None:
        if not self.enabled or self.loss_scale != 0:  # no dynamic scale: its settings are unused
            return
        if self.loss_scale_window < 1:
            raise _bad("fp16.loss_scale_window", self.loss_scale_window, "an integer >= 1")
        if self.min_loss_scale <= 0:
            raise _bad("fp16.min_loss_scale", self.min_loss_scale, "a finite number > 0")


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (old name ``bfloat16``): bf16 mixed precision with fp32 master weights."""

    enabled: bool = _key(False, _bool)
    """Run forward and backward in bfloat16, with fp32 master weights and no loss scaling."""
    bf16_master_weights_and_grads: bool = _key(False, _bool)
    """Keep the master weights in bf16 (2 bytes a parameter instead of 4), as DeepSpeed (ZeRO 1-3 only; without
    bf16_optimizer_states only with ``zero_optimization.offload_optimizer``, whose host update then keeps fp32
    moments). The gradient sums are bf16 too, as DeepSpeed's: each micro-batch's gradient added and the sum
    rounded to nearest, on the device or in host memory (2 bytes a parameter there instead of 4)."""
    bf16_optimizer_states: bool = _key(False, _bool)
    """Keep the optimizer's moments in bf16 too (needs bf16_master_weights_and_grads, as in DeepSpeed)."""
    rounding: str = _key("nearest", _choice("nearest", "stochastic", "kahan"))
    """A dsfunc key: how bf16 masters and moments are rounded after each update, on the device and on the host
    alike. ``nearest`` (DeepSpeed's: its fused and CPU Adam compute in fp32 and round to nearest once);
    ``stochastic`` rounds up with probability equal to the remainder, so that small updates are not lost on
    average; ``kahan`` rounds to nearest and keeps each master's remainder in a bf16 compensation (2 more bytes
    a parameter) that the next update adds back: deterministic, and about fp32's accuracy for the masters."""


_NOT_FOR_BF16 = _reject(
    "loss scaling only applies to fp16; bf16 has the range of fp32 and needs no loss scale. "
    "Remove this key from the bf16 section."
)
_FP16_FIXED = {
    "fp16_master_weights_and_grads": _only(False, feature="fp16 master weights (a ZeRO-Offload feature)")
}
# bf16 keys that tune DeepSpeed's bf16 optimizer; dsfunc's one step has a single behaviour for each
BF16_WITHOUT_EFFECT = {
    "immediate_grad_update": (
        "dsfunc adds each micro-batch's gradients into fp32 sums (bf16 ones with bf16_master_weights_and_grads) "
        "as they are produced (DeepSpeed's true); "
        "DeepSpeed's false keeps them in bf16 until the accumulation boundary"
    ),
    "check_grad_overflow": (
        "dsfunc always checks: a step whose gradients are not finite is skipped (DeepSpeed's true); with "
        "false DeepSpeed's ZeRO 1-2 apply such a step, writing NaN or inf into the weights"
    ),
}
_BF16_FIXED = {
    "immediate_grad_update": _accepted(_bool),
    "check_grad_overflow": _accepted(_bool),
} | {
    key: _NOT_FOR_BF16
    for key in (
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "raise_error_at_min_scale",
    )
}


_DATA_TYPES = _Schema(
    specs={"grad_accum_dtype": _Spec(None, _DTYPE_NAME), "buffer_dtype": _Spec(None, _DTYPE_NAME)},
    fixed={
        "param_dtype": _only(None, feature="a separate parameter dtype"),
        "keep_in_fp32_modules": _only("auto", feature="choosing the modules kept in fp32"),
    },
)


def _data_types(value: Any, path: str) -> dict[str, str | None]:
    """``{"grad_accum_dtype": ..., "buffer_dtype": ...}`` of the ``data_types`` section."""
    return _parse(value, path, _DATA_TYPES)
