"""``deepspeed.runtime.precision_config``: ``get_bfloat16_config``, ``get_float16_config`` and the config models
``DeepSpeedFP16Config`` / ``DeepSpeedBF16Config``, which read one precision section with dsfunc's one parser (the
sections ``DeepSpeedConfig`` and the engine hold: :class:`~dsfunc.config.precision.BF16Config`,
:class:`~dsfunc.config.precision.FP16Config`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsfunc.config.config import _TOP
from dsfunc.config.errors import ConfigError
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


def DeepSpeedFP16Config(**values: Any) -> FP16Config:
    """DeepSpeed's model of the ``fp16`` section built from its keys (``DeepSpeedFP16Config(loss_scale=0, ...)``);
    a bad value raises pydantic's ``ValidationError``, as DeepSpeed's model, where scripts catch it."""
    return _model("DeepSpeedFP16Config", get_float16_config, "fp16", values)


def DeepSpeedBF16Config(**values: Any) -> BF16Config:
    """DeepSpeed's model of the ``bf16`` section built from its keys (see :func:`DeepSpeedFP16Config`)."""
    return _model("DeepSpeedBF16Config", get_bfloat16_config, "bf16", values)


def _model(title: str, read: Any, key: str, values: dict[str, Any]) -> Any:
    """``read({key: values})``; its ConfigError as pydantic's ValidationError (DeepSpeed's config models are
    pydantic's; without pydantic installed, the ConfigError itself)."""
    try:
        return read({key: values})
    except ConfigError as error:
        try:
            from pydantic_core import ValidationError
        except ImportError:
            raise error from None
        raise ValidationError.from_exception_data(title, [
            {"type": "value_error", "loc": (), "input": values, "ctx": {"error": error}}]) from error


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.precision_config`` import, and refuse when used."""
    return other_name("runtime.precision_config", name)
