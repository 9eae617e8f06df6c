"""The ``optimizer`` section: which update rule, with DeepSpeed's defaults for its params."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import (
    _LR,
    _NON_NEGATIVE,
    _accepted,
    _betas,
    _bool,
    _canonical_type,
    _choice,
    _number,
    _only,
    _optional,
    _reject,
)
from dsfunc.config.errors import ConfigError
from dsfunc.config.schema import _REQUIRED, _TYPE_AND_PARAMS, _parse, _Schema, _Spec, _TypedSection


@dataclass(frozen=True)
class OptimizerConfig(_TypedSection):
    """``optimizer``: canonical lower-case ``type`` and its complete, validated ``params``."""


_OPTIMIZER_NAMES = {
    "adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "lamb": "Lamb", "adagrad": "Adagrad", "muon": "Muon",
}
_MAX_GRAD_NORM = _reject(
    "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the deepspeed "
    "parameter 'gradient_clipping' (a top-level key, e.g. \"gradient_clipping\": 1.0)."
)
_EPS = _NON_NEGATIVE
_ADAM = {
    "lr": _Spec(1e-3, _LR),
    "betas": _Spec((0.9, 0.999), _betas),
    "eps": _Spec(1e-8, _EPS),
    "weight_decay": _Spec(0.0, _NON_NEGATIVE),
    "bias_correction": _Spec(True, _bool),
    "adam_w_mode": _Spec(True, _bool),
    "torch_adam": _Spec(False, _bool),
}
_TORCH_ADAMW_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default
_OPTIMIZER_PARAMS = {
    "adam": _ADAM,
    "adamw": _ADAM,
    "sgd": {
        "lr": _Spec(_REQUIRED, _LR),
        "momentum": _Spec(0.0, _NON_NEGATIVE),
        "dampening": _Spec(0.0, _NON_NEGATIVE),
        "weight_decay": _Spec(0.0, _NON_NEGATIVE),
        "nesterov": _Spec(False, _bool),
    },
    "lamb": {
        "lr": _Spec(1e-3, _LR),
        "betas": _Spec((0.9, 0.999), _betas),
        "eps": _Spec(1e-8, _EPS),
        "weight_decay": _Spec(0.0, _NON_NEGATIVE),
        "bias_correction": _Spec(True, _bool),
        "max_coeff": _Spec(10.0, _NON_NEGATIVE),
        "min_coeff": _Spec(0.01, _NON_NEGATIVE),
    },
    "adagrad": {
        "lr": _Spec(1e-2, _LR),
        "lr_decay": _Spec(0.0, _NON_NEGATIVE),
        "weight_decay": _Spec(0.0, _NON_NEGATIVE),
        "initial_accumulator_value": _Spec(0.0, _NON_NEGATIVE),
        "eps": _Spec(1e-10, _EPS),
    },
    # DeepSpeed's engine splits every parameter group into a Muon half (lr, momentum, weight_decay, ns_method)
    # and an Adam half (lr, betas, eps, weight_decay); muon_lr / adam_lr override lr for one half, and a half
    # with no lr at all takes MuonWithAuxAdam's default (0.02 for Muon, 3e-4 for Adam).
    "muon": {
        "lr": _Spec(None, _optional(_LR)),
        "muon_lr": _Spec(None, _optional(_LR)),
        "adam_lr": _Spec(None, _optional(_LR)),
        "momentum": _Spec(0.95, _number(ge=0.0, lt=1.0)),
        "weight_decay": _Spec(0.0, _NON_NEGATIVE),
        "ns_method": _Spec("gram", _choice("gram", "standard")),
        "betas": _Spec((0.9, 0.95), _betas),
        "eps": _Spec(1e-10, _EPS),
        "adam_w_mode": _Spec(True, _bool),
        "torch_adam": _Spec(False, _bool),
    },
}
_MUON_FIXED = {
    "per_head_muon": _only(False, feature="per-head Muon (Newton-Schulz per attention head)"),
}
_OPTIMIZER_SECTION = _Schema(
    specs=_TYPE_AND_PARAMS,
    # DeepSpeed reads torch_adam from params; beside type it has no effect there either (and dsfunc's Adam is one)
    fixed={"legacy_fusion": _only(False, feature="legacy fused optimizers"), "torch_adam": _accepted(_bool)},
)


def _check_optimizer(kind: str, params: dict[str, Any], section: str) -> None:
    """Rules that involve several params."""
    path = f"{section}.params"
    if kind == "adamw" and not params["adam_w_mode"]:
        raise ConfigError(
            f'{path}.adam_w_mode = false contradicts {section}.type "AdamW". For Adam with L2 '
            f'regularisation use "type": "Adam" with "adam_w_mode": false; otherwise drop adam_w_mode.'
        )
    if kind == "sgd" and params["nesterov"] and (params["momentum"] <= 0 or params["dampening"] != 0):
        raise ConfigError(
            f"{path}.nesterov = true requires momentum > 0 and dampening = 0 (as torch.optim.SGD), got "
            f"momentum = {params['momentum']:g} and dampening = {params['dampening']:g}."
        )
    if kind == "lamb" and params["min_coeff"] > params["max_coeff"]:
        raise ConfigError(
            f"{path}.min_coeff = {params['min_coeff']:g} is larger than max_coeff = "
            f"{params['max_coeff']:g}; the trust-ratio clamp needs min_coeff <= max_coeff."
        )


def _optimizer(value: Any, path: str) -> OptimizerConfig:
    section = _parse(value, path, _OPTIMIZER_SECTION)
    kind = _canonical_type(section["type"], f"{path}.type", _OPTIMIZER_NAMES, "optimizer")
    schema = _Schema(
        _OPTIMIZER_PARAMS[kind],
        fixed={"max_grad_norm": _MAX_GRAD_NORM, **(_MUON_FIXED if kind == "muon" else {})},
        what=f'optimizer type "{_OPTIMIZER_NAMES[kind]}"',
    )
    params = _parse(section["params"], f"{path}.params", schema)
    _check_optimizer(kind, params, path)
    given = section["params"] or {}
    if kind in ("adam", "adamw") and params["torch_adam"] and params["adam_w_mode"] and "weight_decay" not in given:
        # DeepSpeed hands the params to torch.optim.AdamW, whose own default decay applies (its fused Adams: 0)
        params["weight_decay"] = _TORCH_ADAMW_WEIGHT_DECAY
    return OptimizerConfig(kind, params)


def parse_optimizer(section: Any) -> OptimizerConfig:
    """A DeepSpeed ``optimizer`` section (``{"type": ..., "params": {...}}``), validated and completed with
    DeepSpeed's defaults as inside a whole config."""
    return _optimizer(section, "optimizer")
