"""The DeepSpeed JSON config, parsed into frozen dataclasses.

``Config.load(source, world_size=...)`` reads a DeepSpeed config (dict, JSON file, base64 JSON, argparse
namespace with ``deepspeed_config``, or a ``Config``) with DeepSpeed 0.19's keys and defaults, resolves the
batch-size triple against the data-parallel world size, and validates every key and value. Each section is
described by a table (``_Schema``): the keys dsfunc implements with their default and check, the known
DeepSpeed keys it accepts only in their default or disabled form, and alternative spellings. Every problem
raises ``ConfigError`` naming the key path.

Where dsfunc deliberately differs from DeepSpeed:

* Unknown or misspelled keys are errors that suggest the closest valid key (DeepSpeed ignores unknown
  top-level keys and keys in its older sections, and only fails on optimizer/scheduler params when the class
  is constructed).
* Known DeepSpeed features that dsfunc does not have (offload, ZeRO++, MiCS, pipeline parallelism, Apex AMP,
  the FLOPs profiler, wandb, ...) are accepted only while disabled or at their default value; asking for them
  is an error saying dsfunc does not support them, never a silent no-op.
* ``"auto"`` values are errors: they are placeholders the Hugging Face Trainer fills in (DeepSpeed drops them
  inside its pydantic sections, i.e. silently uses the default).
* The batch triple follows DeepSpeed's inference, but a train batch that does not divide evenly is reported as
  such (DeepSpeed floor-divides and then fails with a mismatch assertion); every batch error prints all three
  values, the world size, the rule and values that would work.
* Optimizer types are matched case-insensitively; Adam, AdamW, SGD, Lamb and Adagrad are supported. As in
  DeepSpeed, ``"Adam"`` runs decoupled AdamW math unless ``adam_w_mode`` is false; ``"AdamW"`` with
  ``adam_w_mode: false`` is an error (DeepSpeed silently keeps AdamW). Params are validated and completed with
  DeepSpeed's defaults.
* Scheduler types are matched case-insensitively. An unknown ``warmup_type`` is an error (DeepSpeed warns and
  uses "log"); ``total_num_steps < warmup_num_steps`` is an error (DeepSpeed warns); learning rates must be
  scalars (DeepSpeed also takes per-param-group lists). OneCycle's ``cycle_second_*`` values default to the
  ``cycle_first_*`` ones at parse time.
* Loss-scaling keys copied into ``bf16`` are errors (bf16 needs no loss scale; DeepSpeed's pydantic model also
  rejects them).
* Files are strict JSON (DeepSpeed's hjson also takes comments and trailing commas); the error gives line and
  column.
* ``fp16.raise_error_at_min_scale`` is a dsfunc key: false keeps skipping steps at the minimum loss scale
  instead of stopping the run.
* ``zero_allow_untested_optimizer`` is parsed and recorded; this module does not apply DeepSpeed's
  untested-optimizer check.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import difflib
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from dsfunc.frozen import FrozenDict, freeze, thaw

__all__ = [
    "BF16Config",
    "Config",
    "ConfigError",
    "FP16Config",
    "FrozenDict",
    "MonitorConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
]


class ConfigError(ValueError):
    """A problem in a DeepSpeed/dsfunc config; the message names the key path and what is allowed."""


# ----------------------------------------------------------------------------------------------------
# Messages

_AUTO_HELP = (
    '"auto" is a placeholder that the Hugging Face Trainer replaces with a value before DeepSpeed reads '
    "the config; dsfunc reads the config itself, so write the actual value here"
)


def _show(value: Any) -> str:
    """A value as it would appear in the JSON file."""
    try:
        return json.dumps(thaw(value))
    except (TypeError, ValueError):
        return repr(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _bad(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{path} = {_show(value)} is invalid: expected {allowed}.")


def _unknown(path: str, key: str, known: list[str], listed: list[str]) -> ConfigError:
    full = _join(path, str(key))
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    where = f'"{path}"' if path else "the top level"
    if close:
        hint = f'Did you mean "{_join(path, close[0])}"?'
    else:
        hint = f"Valid keys in {where}: {', '.join(listed)}."
    return ConfigError(
        f'Unknown config key "{full}". {hint} (dsfunc rejects unknown keys instead of ignoring them.)'
    )


def _or(items: list[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


# ----------------------------------------------------------------------------------------------------
# Value checks: each takes (value, key path) and returns the normalised value or raises ConfigError.

Check = Callable[[Any, str], Any]


def _bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise _bad(path, value, "true or false")


def _string(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    raise _bad(path, value, "a string")


def _bound_text(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    parts = [
        f">= {ge:g}" if ge is not None else "",
        f"> {gt:g}" if gt is not None else "",
        f"<= {le:g}" if le is not None else "",
        f"< {lt:g}" if lt is not None else "",
    ]
    return " and ".join(p for p in parts if p)


def _in_bounds(x: float, ge: float | None, gt: float | None, le: float | None, lt: float | None) -> bool:
    return (
        (ge is None or x >= ge)
        and (gt is None or x > gt)
        and (le is None or x <= le)
        and (lt is None or x < lt)
    )


def _number(
    *, ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None
) -> Check:
    """A finite real number (int or float, not bool) within the bounds; returned as float."""
    bounds = _bound_text(ge, gt, le, lt)
    allowed = f"a finite number {bounds}".rstrip()

    def check(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(path, value, allowed)
        x = float(value)
        if not math.isfinite(x) or not _in_bounds(x, ge, gt, le, lt):
            raise _bad(path, value, allowed)
        return x

    return check


def _integer(*, ge: int | None = None, le: int | None = None, whole_floats: bool = False) -> Check:
    """An int (not bool) within the bounds; ``whole_floats`` also takes 5e8-style floats with no fraction."""
    bounds = _bound_text(ge, None, le, None)
    allowed = f"an integer {bounds}".rstrip() + (" (5e8-style numbers are fine)" if whole_floats else "")

    def check(value: Any, path: str) -> int:
        if whole_floats and isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not _in_bounds(value, ge, None, le, None):
            raise _bad(path, value, allowed)
        return value

    return check


def _choice(*options: str) -> Check:
    allowed = "one of " + ", ".join(json.dumps(o) for o in options)

    def check(value: Any, path: str) -> str:
        if value not in options or not isinstance(value, str):
            raise _bad(path, value, allowed)
        return value

    return check


def _optional(inner: Check) -> Check:
    """``null`` or whatever ``inner`` accepts."""

    def check(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return check


def _betas(value: Any, path: str) -> tuple[float, float]:
    allowed = "a list of two numbers, each >= 0 and < 1"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _bad(path, value, allowed)
    beta = _number(ge=0.0, lt=1.0)
    try:
        return (beta(value[0], f"{path}[0]"), beta(value[1], f"{path}[1]"))
    except ConfigError:
        raise _bad(path, value, allowed) from None


_SIZE = _integer(ge=0, whole_floats=True)
_NON_NEGATIVE = _number(ge=0.0)
_STEPS = _integer(ge=1)
_DTYPE_NAME = _optional(_choice("fp32", "fp16", "bf16"))


# ----------------------------------------------------------------------------------------------------
# Rules for known DeepSpeed keys that dsfunc accepts only in their default / disabled form.
# A rule takes (value, key path) and raises ConfigError when the value asks for something dsfunc does not do.

Rule = Callable[[Any, str], None]


def _same(value: Any, default: Any) -> bool:
    """JSON-level equality: bool is not a number, strings compare case-insensitively."""
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    if isinstance(value, str) and isinstance(default, str):
        return value.lower() == default.lower()
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    return type(value) is type(default) and value == default


def _only(*accepted: Any, feature: str, fix: str = "") -> Rule:
    """Accept only the listed values (dict defaults are compared key by key, naming the deepest path)."""

    def rule(value: Any, path: str) -> None:
        if len(accepted) == 1 and isinstance(accepted[0], Mapping):
            default = accepted[0]
            if value is None:
                return
            if isinstance(value, Mapping):
                for key, sub in value.items():
                    if key not in default:
                        raise _unknown(path, key, list(default), list(default))
                    _only(default[key], feature=feature, fix=fix)(sub, _join(path, key))
                return
        if any(_same(value, a) for a in accepted):
            return
        if value == "auto":
            raise ConfigError(f'{path} = "auto": {_AUTO_HELP}.')
        shown = _or([_show(a) for a in accepted])
        raise ConfigError(
            f"{path} = {_show(value)}: dsfunc does not support {feature} yet. "
            f"Remove the key or set it to {shown} (DeepSpeed's default).{' ' + fix if fix else ''}"
        )

    return rule


def _off(feature: str, fix: str = "") -> Rule:
    """A section that is accepted while nothing in it is ``"enabled": true`` (other keys are not checked)."""

    def find_enabled(value: Any, path: str) -> str | None:
        if not isinstance(value, Mapping):
            return None
        for key, sub in value.items():
            sub_path = _join(path, key)
            if key != "enabled":
                found = find_enabled(sub, sub_path)
            elif sub == "auto":
                raise ConfigError(f'{sub_path} = "auto": {_AUTO_HELP}.')
            elif not isinstance(sub, (bool, type(None))):
                raise _bad(sub_path, sub, "true or false")
            else:
                found = sub_path if sub else None
            if found is not None:
                return found
        return None

    def rule(value: Any, path: str) -> None:
        if value is not None and not isinstance(value, Mapping):
            raise _bad(path, value, "a JSON object")
        enabled = find_enabled(value, path)
        if enabled is not None:
            raise ConfigError(
                f"{enabled} = true: dsfunc does not support {feature} yet. "
                f'Set it to false or remove "{path}".'
                f"{' ' + fix if fix else ''}"
            )

    return rule


def _empty(feature: str) -> Rule:
    """A section accepted only when empty or null."""

    def rule(value: Any, path: str) -> None:
        if value is None or (isinstance(value, Mapping) and not value):
            return
        raise ConfigError(f'{path} = {_show(value)}: dsfunc does not support {feature} yet. Remove "{path}".')

    return rule


def _inert(value: Any, path: str) -> None:
    """Keys that only tune machinery dsfunc does not have (e.g. NVMe I/O); accepted as they are."""


def _offload(what: str) -> Rule:
    def rule(value: Any, path: str) -> None:
        if value is None:
            return
        if not isinstance(value, Mapping):
            raise _bad(path, value, 'a JSON object such as {"device": "none"}')
        device = value.get("device", "none")
        if device not in (None, "none"):
            raise ConfigError(
                f"{path}.device = {_show(device)}: offloading {what} to CPU/NVMe (ZeRO-Offload / "
                f'ZeRO-Infinity) is not supported by dsfunc. Remove "{path}" or set its device to "none"; '
                f"ZeRO stage 3 shards parameters, gradients and optimizer state across ranks instead."
            )

    return rule


def _reject(message: str) -> Rule:
    def rule(value: Any, path: str) -> None:
        raise ConfigError(f"{path}: {message}")

    return rule


# ----------------------------------------------------------------------------------------------------
# Section schemas


_REQUIRED = object()


def _as_is(value: Any, path: str) -> Any:
    """For keys whose value the caller checks (the type and params of an optimizer or scheduler)."""
    return value


class _Spec(NamedTuple):
    """A key dsfunc implements: its default (or ``_REQUIRED``) and the check that normalises its value."""

    default: Any
    check: Check


class _Schema(NamedTuple):
    specs: Mapping[str, _Spec]
    fixed: Mapping[str, Rule] = {}  # known DeepSpeed keys accepted only in their default / disabled form
    aliases: Mapping[str, str] = {}  # other spelling -> canonical key
    what: str = ""  # for "required for ..." messages


def _key(default: Any, check: Check) -> Any:
    """A dataclass field that is also a config key (default + check live next to the type)."""
    return field(default=default, metadata={"check": check})


def _specs_of(cls: type) -> dict[str, _Spec]:
    return {
        f.name: _Spec(f.default, f.metadata["check"])
        for f in dataclasses.fields(cls)
        if "check" in f.metadata
    }


def _parse(value: Any, path: str, schema: _Schema) -> dict[str, Any]:
    """Validate one JSON object against a schema; returns every implemented key, defaults filled in."""
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise _bad(path, value, "a JSON object")
    data: dict[str, Any] = {}
    for key, sub in value.items():
        canonical = schema.aliases.get(key, key)
        if canonical in data:
            first = data[canonical][0]
            raise ConfigError(
                f'"{_join(path, first)}" and "{_join(path, key)}" are two spellings of the same key '
                f"({_join(path, canonical)}); keep one."
            )
        data[canonical] = (key, sub)
    known = [*schema.specs, *schema.fixed, *schema.aliases]
    for canonical, (key, _) in data.items():
        if canonical not in schema.specs and canonical not in schema.fixed:
            raise _unknown(path, key, known, list(schema.specs))
    for canonical, rule in schema.fixed.items():
        if canonical in data:
            key, sub = data[canonical]
            rule(sub, _join(path, key))
    out = {}
    for name, spec in schema.specs.items():
        if name in data:
            key, sub = data[name]
            if isinstance(sub, str) and sub == "auto":
                raise ConfigError(f'{_join(path, key)} = "auto": {_AUTO_HELP}.')
            out[name] = spec.check(sub, _join(path, key))
        elif spec.default is _REQUIRED:
            raise ConfigError(
                f"{_join(path, name)} is required{' for ' + schema.what if schema.what else ''}."
            )
        else:
            out[name] = spec.default
    return out


def _section(cls: type, fixed: Mapping[str, Rule] = {}, aliases: Mapping[str, str] = {}) -> Check:
    """The check for a JSON object that becomes a frozen dataclass ``cls``."""
    schema = _Schema(_specs_of(cls), fixed, aliases)

    def check(value: Any, path: str) -> Any:
        return cls(**_parse(value, path, schema))

    return check


def _canonical_type(value: Any, path: str, names: Mapping[str, str], kind: str) -> str:
    """Match ``names`` (canonical -> DeepSpeed spelling) case-insensitively."""
    if not isinstance(value, str):
        raise _bad(path, value, f"one of {', '.join(names.values())}")
    by_lower = {spelling.lower(): canonical for canonical, spelling in names.items()}
    if value.lower() in by_lower:
        return by_lower[value.lower()]
    spellings = list(names.values())
    close = difflib.get_close_matches(value.lower(), [s.lower() for s in spellings], n=1, cutoff=0.6)
    hint = f' Did you mean "{names[by_lower[close[0]]]}"?' if close else ""
    raise ConfigError(
        f"{path} = {_show(value)}: this {kind} is not supported by dsfunc "
        f"(supported: {', '.join(spellings)}).{hint}"
    )


# ----------------------------------------------------------------------------------------------------
# optimizer


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: canonical lower-case ``type`` and its complete, validated ``params``."""

    type: str
    params: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", freeze(self.params))


_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "lamb": "Lamb", "adagrad": "Adagrad"}
_MAX_GRAD_NORM = _reject(
    "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the deepspeed "
    "parameter 'gradient_clipping' (a top-level key, e.g. \"gradient_clipping\": 1.0)."
)
_LR = _NON_NEGATIVE
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
}
_OPTIMIZER_SECTION = _Schema(
    specs={"type": _Spec(_REQUIRED, _as_is), "params": _Spec(None, _as_is)},
    fixed={"legacy_fusion": _only(False, feature="legacy fused optimizers")},
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
        fixed={"max_grad_norm": _MAX_GRAD_NORM},
        what=f'optimizer type "{_OPTIMIZER_NAMES[kind]}"',
    )
    params = _parse(section["params"], f"{path}.params", schema)
    _check_optimizer(kind, params, path)
    return OptimizerConfig(kind, params)


# ----------------------------------------------------------------------------------------------------
# scheduler


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: canonical ``type`` (DeepSpeed's class name) and its complete, validated ``params``."""

    type: str
    params: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", freeze(self.params))


_SCHEDULER_NAMES = {
    name: name for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
}
_LAST_ITERATION = _Spec(-1, _integer(ge=-1))
_WARMUP_STEPS = _Spec(1000, _STEPS)
_WARMUP_TYPE = _Spec("log", _choice("log", "linear"))
_TOTAL_STEPS = _Spec(_REQUIRED, _STEPS)
_SCHEDULER_PARAMS = {
    "WarmupLR": {
        "warmup_min_lr": _Spec(0.0, _LR),
        "warmup_max_lr": _Spec(None, _optional(_LR)),
        "warmup_num_steps": _WARMUP_STEPS,
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _LAST_ITERATION,
    },
    "WarmupDecayLR": {
        "total_num_steps": _TOTAL_STEPS,
        "warmup_min_lr": _Spec(0.0, _LR),
        "warmup_max_lr": _Spec(0.001, _LR),
        "warmup_num_steps": _WARMUP_STEPS,
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _LAST_ITERATION,
    },
    "WarmupCosineLR": {
        "total_num_steps": _TOTAL_STEPS,
        "warmup_min_ratio": _Spec(0.0, _NON_NEGATIVE),
        "warmup_num_steps": _WARMUP_STEPS,
        "cos_min_ratio": _Spec(0.0001, _NON_NEGATIVE),
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _LAST_ITERATION,
    },
    "OneCycle": {
        "cycle_min_lr": _Spec(_REQUIRED, _LR),
        "cycle_max_lr": _Spec(_REQUIRED, _LR),
        "decay_lr_rate": _Spec(0.0, _NON_NEGATIVE),
        "cycle_first_step_size": _Spec(2000, _STEPS),
        "cycle_second_step_size": _Spec(None, _optional(_STEPS)),
        "cycle_first_stair_count": _Spec(0, _integer(ge=0)),
        "cycle_second_stair_count": _Spec(None, _optional(_integer(ge=0))),
        "decay_step_size": _Spec(0, _integer(ge=0)),
        "cycle_momentum": _Spec(True, _bool),
        "cycle_min_mom": _Spec(0.8, _number(ge=0.0, lt=1.0)),
        "cycle_max_mom": _Spec(0.9, _number(ge=0.0, lt=1.0)),
        "decay_mom_rate": _Spec(0.0, _NON_NEGATIVE),
        "last_batch_iteration": _LAST_ITERATION,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": _Spec(1e-3, _LR),
        "lr_range_test_step_size": _Spec(2000, _STEPS),
        "lr_range_test_step_rate": _Spec(1.0, _NON_NEGATIVE),
        "lr_range_test_staircase": _Spec(False, _bool),
        "last_batch_iteration": _LAST_ITERATION,
    },
}
_SCHEDULER_SECTION = _Schema(specs={"type": _Spec(_REQUIRED, _as_is), "params": _Spec(None, _as_is)})


def _scheduler(value: Any, path: str) -> SchedulerConfig:
    section = _parse(value, path, _SCHEDULER_SECTION)
    kind = _canonical_type(section["type"], f"{path}.type", _SCHEDULER_NAMES, "LR scheduler")
    params = _parse(
        section["params"], f"{path}.params", _Schema(_SCHEDULER_PARAMS[kind], what=f'scheduler "{kind}"')
    )
    if "total_num_steps" in params and params["total_num_steps"] < params["warmup_num_steps"]:
        raise ConfigError(
            f"{path}.params.total_num_steps = {params['total_num_steps']} is smaller than warmup_num_steps = "
            f"{params['warmup_num_steps']} (default 1000 when not set): the schedule would end inside the "
            f"warmup. Set warmup_num_steps <= total_num_steps."
        )
    if kind == "OneCycle":
        for phase in ("step_size", "stair_count"):
            if params[f"cycle_second_{phase}"] is None:
                params[f"cycle_second_{phase}"] = params[f"cycle_first_{phase}"]
    return SchedulerConfig(kind, params)


# ----------------------------------------------------------------------------------------------------
# precision, ZeRO, monitors


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


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: the ZeRO stage and its tuning knobs (sizes are in elements)."""

    stage: int = _key(0, _integer(ge=0, le=3))
    reduce_bucket_size: int = _key(500_000_000, _SIZE)
    allgather_bucket_size: int = _key(500_000_000, _SIZE)
    overlap_comm: bool = _key(None, _optional(_bool))  # None -> True for stage 3, else False
    contiguous_gradients: bool = _key(True, _bool)
    reduce_scatter: bool = _key(True, _bool)
    allgather_partitions: bool = _key(True, _bool)
    stage3_prefetch_bucket_size: int = _key(50_000_000, _SIZE)
    stage3_param_persistence_threshold: int = _key(100_000, _SIZE)
    stage3_max_live_parameters: int = _key(1_000_000_000, _SIZE)
    stage3_max_reuse_distance: int = _key(1_000_000_000, _SIZE)
    stage3_gather_16bit_weights_on_model_save: bool = _key(False, _bool)
    ignore_unused_parameters: bool = _key(True, _bool)
    sub_group_size: int = _key(1_000_000_000, _SIZE)
    round_robin_gradients: bool = _key(False, _bool)

    def __post_init__(self) -> None:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)


_ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    # deprecated name:
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "partition_stream_chunk_size": "stage3_partition_stream_chunk_size",
}
_ZERO_FIXED: dict[str, Rule] = {
    "offload_optimizer": _offload("optimizer state"),
    "offload_param": _offload("parameters"),
    "cpu_offload": _only(None, False, feature="ZeRO-Offload (cpu_offload)"),
    "cpu_offload_param": _only(None, False, feature="ZeRO-Offload of parameters (cpu_offload_param)"),
    "cpu_offload_use_pin_memory": _inert,
    "zenflow": _only(None, feature="ZenFlow"),
    "use_multi_rank_bucket_allreduce": _only(True, feature="disabling multi-rank bucket all-reduce"),
    "load_from_fp32_weights": _only(
        True, feature="rebuilding fp32 master weights from 16-bit checkpoint weights"
    ),
    "elastic_checkpoint": _only(
        False, feature="legacy elastic checkpoints (dsfunc checkpoints always reshard)"
    ),
    "stage3_model_persistence_threshold": _only(sys.maxsize, feature="a model persistence threshold"),
    "stage3_module_granularity_threshold": _only(0, feature="a module granularity threshold"),
    "stage3_use_all_reduce_for_fetch_params": _only(False, feature="all-reduce parameter fetching"),
    "stage3_allgather_sequential": _only(False, feature="sequential all-gathers"),
    "stage3_partition_stream_chunk_size": _only(0, feature="streamed parameter partitioning"),
    "legacy_stage1": _only(False, feature="the legacy ZeRO stage 1 implementation"),
    "zero_hpz_partition_size": _only(1, feature="ZeRO++ hierarchical partitioning (hpZ)"),
    "zero_quantized_weights": _only(False, feature="ZeRO++ quantized weights"),
    "zero_quantized_nontrainable_weights": _only(False, feature="ZeRO++ quantized non-trainable weights"),
    "zero_quantized_gradients": _only(False, feature="ZeRO++ quantized gradients"),
    "zeropp_loco_param": _only(None, feature="ZeRO++ LoCo"),
    "mics_shard_size": _only(-1, feature="MiCS sharding"),
    "mics_hierarchical_params_gather": _only(False, feature="MiCS hierarchical gathers"),
    "memory_efficient_linear": _only(True, feature="disabling the memory-efficient linear"),
    "override_module_apply": _only(True, feature="disabling the nn.Module.apply override"),
    "pipeline_loading_checkpoint": _only(False, feature="pipeline-mode checkpoint loading"),
    "log_trace_cache_warnings": _only(False, feature="trace-cache warnings"),
    "enable_sanity_checks": _only(False, feature="DeepSpeed's internal sanity checks"),
    "save_muon_momentum_buffer_in_memory": _only(False, feature="the Muon optimizer"),
    "leaf_module": _empty("ZeRO-3 leaf modules"),
}
_ZERO_SECTION = _section(ZeroConfig, _ZERO_FIXED, _ZERO_ALIASES)


def _zero(value: Any, path: str) -> ZeroConfig:
    if isinstance(value, bool):  # legacy "zero_optimization": true|false = stage 1|0
        return ZeroConfig(stage=int(value))
    return _ZERO_SECTION(value, path)


@dataclass(frozen=True)
class MonitorConfig:
    """``tensorboard`` / ``csv_monitor``: events go to ``os.path.join(output_path, job_name)`` on rank 0."""

    enabled: bool = _key(False, _bool)
    output_path: str = _key("", _string)
    job_name: str = _key("DeepSpeedJobName", _string)


_DATA_TYPES = _Schema(
    specs={"grad_accum_dtype": _Spec(None, _DTYPE_NAME)},
    fixed={
        "param_dtype": _only(None, feature="a separate parameter dtype"),
        "buffer_dtype": _only(None, feature="a separate buffer dtype"),
    },
)


def _grad_accum_dtype(value: Any, path: str) -> str | None:
    return _parse(value, path, _DATA_TYPES)["grad_accum_dtype"]


def _batch_size(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(path, value, "a positive integer")
    return value


# ----------------------------------------------------------------------------------------------------
# top level

_UNSUPPORTED_TOP: dict[str, Rule] = {
    "amp": _off("Apex AMP", 'Use "fp16" or "bf16" instead.'),
    "flops_profiler": _off("the FLOPs profiler"),
    "activation_checkpointing": _only(
        {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
        feature="DeepSpeed's activation checkpointing",
        fix="Use torch.utils.checkpoint inside the model.",
    ),
    "autotuning": _off("autotuning"),
    "elasticity": _off("elastic batch sizes"),
    "pipeline": _only(
        {
            "stages": "auto",
            "partition": "best",
            "seed_layers": False,
            "activation_checkpoint_interval": 0,
            "pipe_partitioned": True,
            "grad_partitioned": True,
        },
        feature="pipeline parallelism",
    ),
    "sparse_attention": _empty("sparse attention"),
    "compression_training": _off("compression training"),
    "data_efficiency": _off("data efficiency (curriculum learning, random-LTD)"),
    "curriculum_learning": _off("curriculum learning"),
    "wandb": _off("the Weights & Biases monitor", 'dsfunc has "tensorboard" and "csv_monitor".'),
    "comet": _off("the Comet monitor", 'dsfunc has "tensorboard" and "csv_monitor".'),
    "comms_logger": _off("the communication logger"),
    "aio": _inert,  # tunes NVMe I/O, which only offload (rejected) uses
    "checkpoint": _only(
        {
            "tag_validation": "Warn",
            "load_universal": False,
            "use_node_local_storage": False,
            "parallel_write": {"pipeline_stage": False},
        },
        feature="these checkpoint options",
        fix="dsfunc checkpoints load at any world size without conversion.",
    ),
    "timers": _only(
        {"throughput": {"enabled": True, "synchronized": True}}, feature="configuring the timers"
    ),
    "memory_breakdown": _only(False, feature="memory breakdown logging"),
    "dump_state": _only(False, feature="dumping the engine state"),
    "log_level": _only(
        None,
        feature="log_level",
        fix='dsfunc logs to the "dsfunc" logger; set its level with the logging module.',
    ),
    "vocabulary_size": _inert,  # DeepSpeed only warns when it is not a multiple of 8
    "sparse_gradients": _only(False, feature="sparse embedding gradients"),
    "zero_force_ds_cpu_optimizer": _inert,  # only concerns CPU offload, which is rejected
    "disable_allgather": _only(False, feature="disable_allgather"),
    "gradient_allreduce_op": _only("mean", feature="summed gradient reduction"),
    "torch_autocast": _off("torch.autocast mixed precision", 'Use "fp16" or "bf16".'),
    "progressive_layer_drop": _off("progressive layer drop"),
    "eigenvalue": _off("eigenvalue computation"),
    "hybrid_engine": _off("the hybrid (RLHF) engine"),
    "compile": _off("DeepSpeed's torch.compile integration"),
    "nebula": _off("Nebula checkpointing"),
    "quantize_training": _off("quantized training"),
    "weight_quantization": _empty("weight quantization"),
    "tensor_parallel": _empty("tensor parallelism"),
    "expert_parallel": _empty("expert parallelism"),
    "sequence_parallel_size": _only(1, feature="sequence parallelism"),
    "seq_parallel_communication_data_type": _inert,  # only used by sequence parallelism
    "managed_gradient_accumulation": _only(True, feature="unmanaged gradient accumulation"),
}


@dataclass(frozen=True)
class Config:
    """A resolved, validated DeepSpeed config. Build it with ``Config.load``."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int  # the data-parallel size the batch triple was resolved against
    optimizer: OptimizerConfig | None
    scheduler: SchedulerConfig | None
    fp16: FP16Config
    bf16: BF16Config
    zero_optimization: ZeroConfig
    gradient_clipping: float = _key(1.0, _NON_NEGATIVE)  # DeepSpeed >= 0.19.3; 0 disables
    steps_per_print: int | None = _key(None, _optional(_STEPS))
    wall_clock_breakdown: bool = _key(False, _bool)
    communication_data_type: str | None = _key(None, _DTYPE_NAME)
    prescale_gradients: bool = _key(False, _bool)
    gradient_predivide_factor: float = _key(1.0, _number(gt=0.0))
    dataloader_drop_last: bool = _key(False, _bool)
    zero_allow_untested_optimizer: bool = _key(False, _bool)
    grad_accum_dtype: str | None = None  # from data_types.grad_accum_dtype
    tensorboard: MonitorConfig = MonitorConfig()
    csv_monitor: MonitorConfig = MonitorConfig()
    raw: Mapping[str, Any] = FrozenDict()  # the user's dict as given

    def __post_init__(self) -> None:
        object.__setattr__(self, "raw", freeze(self.raw))
        t, m, g, w = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            self.world_size,
        )
        if t != m * g * w:
            raise ConfigError(_mismatch_message(t, m, g, w))
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled and bf16.enabled are both true: bfloat16 and fp16 modes cannot be "
                "simultaneously enabled. Enable only one of them."
            )

    @classmethod
    def load(cls, source: Any, *, world_size: int | None = None) -> Config:
        """Read and validate a DeepSpeed config.

        Args:
            source: a dict; a path (str or PathLike) to a JSON file; a urlsafe-base64 JSON string;
                an ``argparse.Namespace`` whose ``deepspeed_config`` is a path or dict; or a ``Config``
                (returned as is, or re-resolved from its ``raw`` dict when ``world_size`` differs).
            world_size: the data-parallel size for the batch triple; None means the torch.distributed
                world size when a process group is initialised, else 1.

        Returns:
            The resolved ``Config``. Raises ``ConfigError`` naming the key path on any problem.
        """
        world = _world_size(world_size)
        if isinstance(source, Config):
            return source if source.world_size == world else cls._from_dict(source.raw, world)
        return cls._from_dict(_read_source(source), world)

    @classmethod
    def _from_dict(cls, raw: Mapping[str, Any], world_size: int) -> Config:
        values = _parse(raw, "", _TOP)
        values["grad_accum_dtype"] = values.pop("data_types")
        triple = _resolve_batch(
            values.pop("train_batch_size"),
            values.pop("train_micro_batch_size_per_gpu"),
            values.pop("gradient_accumulation_steps"),
            world_size,
        )
        return cls(*triple, world_size=world_size, raw=raw, **values)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward/backward run in: bfloat16, float16 or float32."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    def to_dict(self) -> dict[str, Any]:
        """The resolved values as plain JSON data.

        ``Config.load`` of the result at the same world size gives a Config with equal values.
        """
        out: dict[str, Any] = {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        for name in ("optimizer", "scheduler"):
            section = getattr(self, name)
            out[name] = None if section is None else {"type": section.type, "params": thaw(section.params)}
        for name in ("fp16", "bf16", "zero_optimization", "tensorboard", "csv_monitor"):
            out[name] = dataclasses.asdict(getattr(self, name))
        for f in dataclasses.fields(self):
            if "check" in f.metadata:
                out[f.name] = getattr(self, f.name)
        out["data_types"] = {"grad_accum_dtype": self.grad_accum_dtype}
        return out


_TOP = _Schema(
    specs={
        "train_batch_size": _Spec(None, _optional(_batch_size)),
        "train_micro_batch_size_per_gpu": _Spec(None, _optional(_batch_size)),
        "gradient_accumulation_steps": _Spec(None, _optional(_batch_size)),
        "optimizer": _Spec(None, _optional(_optimizer)),
        "scheduler": _Spec(None, _optional(_scheduler)),
        "fp16": _Spec(FP16Config(), _section(FP16Config, _FP16_FIXED)),
        "bf16": _Spec(BF16Config(), _section(BF16Config, _BF16_FIXED)),
        "zero_optimization": _Spec(ZeroConfig(), _zero),
        "data_types": _Spec(None, _grad_accum_dtype),
        "tensorboard": _Spec(MonitorConfig(), _section(MonitorConfig)),
        "csv_monitor": _Spec(MonitorConfig(), _section(MonitorConfig)),
    }
    | _specs_of(Config),
    fixed=_UNSUPPORTED_TOP,
    aliases={"bfloat16": "bf16"},
)


# ----------------------------------------------------------------------------------------------------
# batch triple

_RULE = "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"


def _report(t: int | None, m: int | None, g: int | None, w: int) -> str:
    def show(v: int | None) -> str:
        return "not set" if v is None else str(v)

    return (
        f"\n  train_batch_size = {show(t)}\n  train_micro_batch_size_per_gpu = {show(m)}"
        f"\n  gradient_accumulation_steps = {show(g)}\n  world_size = {w} (data-parallel ranks)"
        f"\nRule: {_RULE}."
    )


def _multiples_near(x: int, k: int) -> list[int]:
    low = x // k * k
    return [v for v in (low, low + k) if v > 0]


def _divisors_near(n: int, target: int, count: int = 4) -> list[int]:
    divisors = {d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}
    return sorted(sorted(divisors, key=lambda d: (abs(d - target), d))[:count])


def _suggest(lines: list[str]) -> str:
    return "\nValues that would work:" + "".join(f"\n  - {line}" for line in lines)


def _not_divisible(
    derived: str,
    t: int,
    k: int,
    product: str,
    m: int | None,
    g: int | None,
    w: int,
    vary: tuple[str, int] | None,
) -> ConfigError:
    """``t`` is not a multiple of ``k`` (= ``product``), so ``derived`` cannot be derived.

    ``vary`` names the given key (and its value) that could change instead of train_batch_size.
    """
    trains = _multiples_near(t, k)
    lines = [f"train_batch_size = {_or(trains)} ({derived} {_or([v // k for v in trains])})"]
    if vary is not None and t % w == 0:
        name, current = vary
        lines.append(
            f"{name} = {_or(_divisors_near(t // w, current))} (divisors of train_batch_size / world_size "
            f"= {t // w})"
        )
    return ConfigError(
        f"Cannot derive {derived}: train_batch_size = {t} is not divisible by {product} = {k}."
        + _report(t, m, g, w)
        + _suggest(lines)
    )


def _mismatch_message(t: int, m: int, g: int, w: int) -> str:
    lines = [f"train_batch_size = {m * g * w} (keeping micro batch and accumulation steps)"]
    if t % (m * w) == 0:
        lines.append(f"gradient_accumulation_steps = {t // (m * w)} (keeping train batch and micro batch)")
    if t % (g * w) == 0:
        lines.append(
            f"train_micro_batch_size_per_gpu = {t // (g * w)} (keeping train batch and accumulation steps)"
        )
    lines.append("or leave one of the three out and dsfunc derives it")
    return (
        f"Inconsistent batch sizes: train_batch_size must equal train_micro_batch_size_per_gpu * "
        f"gradient_accumulation_steps * world_size, but {t} != {m} * {g} * {w} = {m * g * w}."
        + _report(t, m, g, w)
        + _suggest(lines)
    )


def _resolve_batch(t: int | None, m: int | None, g: int | None, w: int) -> tuple[int, int, int]:
    """DeepSpeed's six-way inference of (train_batch_size, micro batch, accumulation steps)."""
    if t is None and m is None:
        raise ConfigError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided: set "
            "train_micro_batch_size_per_gpu (samples per rank per forward/backward), optionally with "
            "gradient_accumulation_steps, or set train_batch_size (samples per optimizer step, all ranks)."
            + _report(t, m, g, w)
        )
    if t is not None and m is not None and g is None:
        if t % (m * w):
            raise _not_divisible(
                "gradient_accumulation_steps",
                t,
                m * w,
                f"train_micro_batch_size_per_gpu * world_size = {m} * {w}",
                m,
                g,
                w,
                vary=("train_micro_batch_size_per_gpu", m),
            )
        g = t // m // w
    elif t is not None and g is not None and m is None:
        if t % (g * w):
            raise _not_divisible(
                "train_micro_batch_size_per_gpu",
                t,
                g * w,
                f"gradient_accumulation_steps * world_size = {g} * {w}",
                m,
                g,
                w,
                vary=("gradient_accumulation_steps", g),
            )
        m = t // w // g
    elif t is not None and m is None:
        if t % w:
            raise _not_divisible("train_micro_batch_size_per_gpu", t, w, "world_size", m, g, w, vary=None)
        g, m = 1, t // w
    elif t is None:
        g = 1 if g is None else g
        t = m * g * w
    if t != m * g * w:
        raise ConfigError(_mismatch_message(t, m, g, w))
    return t, m, g


# ----------------------------------------------------------------------------------------------------
# sources


def _world_size(world_size: int | None) -> int:
    if world_size is None:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size = {world_size!r} is invalid: expected a positive integer.")
    return world_size


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f'Duplicate key "{key}" in the config; keep one.')
        out[key] = value
    return out


def _json_hint(text: str, error: json.JSONDecodeError) -> str:
    rest = text[error.pos :].lstrip()
    before = text[: error.pos].rstrip()
    if rest.startswith(("//", "/*", "#")):
        return " It looks like a comment: dsfunc reads strict JSON, remove comments."
    if before.endswith(",") and rest[:1] in ("}", "]"):
        return " It looks like a trailing comma: dsfunc reads strict JSON, remove it."
    return ""


def _read_file(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(
            f"Cannot read the DeepSpeed config file {os.fspath(path)!r}: {e.strerror}."
        ) from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{os.fspath(path)}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}."
            + _json_hint(text, e)
        ) from None
    except ConfigError as e:
        raise ConfigError(f"{os.fspath(path)}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{os.fspath(path)}: the config must be a JSON object, got {type(data).__name__}.")
    return data


def _read_base64(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(base64.urlsafe_b64decode(text.encode("ascii")), object_pairs_hook=_no_duplicates)
    except (ValueError, binascii.Error, UnicodeError):
        return None
    return data if isinstance(data, dict) else None


def _read_source(source: Any) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    if isinstance(source, argparse.Namespace):
        inner = getattr(source, "deepspeed_config", None)
        if inner is None:
            raise ConfigError(
                "args.deepspeed_config is not set: pass --deepspeed_config ds_config.json (the flag "
                "comes from dsfunc.add_config_arguments) or give the config directly."
            )
        if isinstance(inner, argparse.Namespace):
            raise ConfigError("args.deepspeed_config must be a path or a dict, not another Namespace.")
        return _read_source(inner)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.exists(source)):
        return _read_file(source)
    if isinstance(source, str):
        data = _read_base64(source)
        if data is not None:
            return data
        raise ConfigError(
            f"DeepSpeed config file {source!r} does not exist (nor is the string base64-encoded JSON)."
        )
    raise ConfigError(
        f"Cannot read a DeepSpeed config from a {type(source).__name__}: expected a dict, a path to a "
        f"JSON file, an argparse.Namespace with deepspeed_config, or a Config."
    )
