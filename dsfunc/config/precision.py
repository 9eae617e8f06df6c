"""The ``fp16``, ``bf16`` and ``data_types`` sections: compute dtype, loss scaling, accumulation dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _DTYPE_NAME, _NON_NEGATIVE, _bool, _integer, _number, _only, _reject
from dsfunc.config.schema import _key, _parse, _Schema, _Spec


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: fp16 mixed precision and (dynamic) loss scaling."""

    enabled: bool = _key(False, _bool)
    loss_scale: float = _key(0.0, _NON_NEGATIVE)  # 0 = dynamic
    initial_scale_power: int = _key(16, _integer(ge=0, le=127))  # fp32 holds 2**127
    loss_scale_window: int = _key(1000, _integer(ge=1))
    hysteresis: int = _key(2, _integer(ge=1))
    consecutive_hysteresis: bool = _key(False, _bool)
    min_loss_scale: float = _key(1.0, _number(gt=0.0))
    auto_cast: bool = _key(False, _bool)
    raise_error_at_min_scale: bool = _key(True, _bool)  # dsfunc key


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (old name ``bfloat16``): bf16 mixed precision with fp32 master weights."""

    enabled: bool = _key(False, _bool)


_NOT_FOR_BF16 = _reject(
    "loss scaling only applies to fp16; bf16 has the range of fp32 and needs no loss scale. "
    "Remove this key from the bf16 section."
)
_FP16_FIXED = {
    "fp16_master_weights_and_grads": _only(False, feature="fp16 master weights (a ZeRO-Offload feature)")
}
_BF16_FIXED = {
    "immediate_grad_update": _only(False, feature="immediate gradient updates"),
    "check_grad_overflow": _only(
        True, feature="applying non-finite bf16 gradients (dsfunc always skips such steps)"
    ),
    "bf16_master_weights_and_grads": _only(False, feature="bf16 master weights (dsfunc keeps fp32 masters)"),
    "bf16_optimizer_states": _only(False, feature="bf16 optimizer states"),
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
    specs={"grad_accum_dtype": _Spec(None, _DTYPE_NAME)},
    fixed={
        "param_dtype": _only(None, feature="a separate parameter dtype"),
        "buffer_dtype": _only(None, feature="a separate buffer dtype"),
        "keep_in_fp32_modules": _only("auto", feature="choosing the modules kept in fp32"),
    },
)


def _grad_accum_dtype(value: Any, path: str) -> str | None:
    return _parse(value, path, _DATA_TYPES)["grad_accum_dtype"]
