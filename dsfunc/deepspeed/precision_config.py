"""``deepspeed.runtime.precision_config``: ``get_bfloat16_config`` and ``get_float16_config``, which read one
precision section of a config dict with dsfunc's one parser (the sections ``DeepSpeedConfig`` and the engine
hold: :class:`~dsfunc.config.precision.BF16Config`, :class:`~dsfunc.config.precision.FP16Config`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsfunc.config.config import _TOP
from dsfunc.config.precision import BF16Config, FP16Config
from dsfunc.config.schema import _parse, _Schema
from dsfunc.deepspeed.namespace import other_name


def _precision_section(param_dict: Mapping[str, Any], key: str) -> Any:
    """The ``key`` section of a whole config dict (its other spellings too), parsed as in the whole config."""
    aliases = {alias: key for alias, canonical in _TOP.aliases.items() if canonical == key}
    schema = _Schema(specs={key: _TOP.specs[key]}, aliases=aliases)
    return _parse({k: v for k, v in param_dict.items() if k == key or k in aliases}, "", schema)[key]


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> BF16Config:
    """The ``bf16`` section (old name ``bfloat16``) of a config dict; off when absent."""
    return _precision_section(param_dict, "bf16")


def get_float16_config(param_dict: Mapping[str, Any]) -> FP16Config:
    """The ``fp16`` section of a config dict; off when absent."""
    return _precision_section(param_dict, "fp16")


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.precision_config`` import, and refuse when used."""
    return other_name("runtime.precision_config", name)
