"""The table language of the config: a section is a ``_Schema`` of keys, and ``_parse`` checks a JSON object
against it.

A key dsfunc implements is a ``_Spec`` (default and check); a known DeepSpeed key it only accepts in its
default or disabled form has a rule (:mod:`dsfunc.config.checks`); an alias maps another spelling to its
canonical key. Anything else is an unknown key, reported with the closest valid one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dsfunc.config.errors import ConfigError, _auto, _bad, _join, _unknown
from dsfunc.frozen import freeze

# A check takes (value, key path) and returns the normalised value or raises ConfigError.
Check = Callable[[Any, str], Any]
# A rule takes (value, key path) and raises ConfigError when the value asks for something dsfunc does not do.
Rule = Callable[[Any, str], None]


_REQUIRED = object()


class _Spec(NamedTuple):
    """A key dsfunc implements: its default (or ``_REQUIRED``) and the check that normalises its value."""

    default: Any
    check: Check


class _Schema(NamedTuple):
    specs: Mapping[str, _Spec]
    fixed: Mapping[str, Rule] = {}  # known DeepSpeed keys accepted only in their default / disabled form
    aliases: Mapping[str, str] = {}  # other spelling -> canonical key
    what: str = ""  # for "required for ..." messages


def _as_is(value: Any, path: str) -> Any:
    """For keys whose value the caller checks (the type and params of an optimizer or scheduler)."""
    return value


# optimizer and scheduler: which params are valid depends on the type, so their modules check both
_TYPE_AND_PARAMS = {"type": _Spec(_REQUIRED, _as_is), "params": _Spec(None, _as_is)}


@dataclass(frozen=True)
class _TypedSection:
    """A section that names a class (``type``) and gives its ``params``, frozen."""

    type: str
    """The canonical name (matched case-insensitively): lower-case for an optimizer, DeepSpeed's class name
    for a scheduler.
    """
    params: Mapping[str, Any]
    """Every param of that type, validated, with DeepSpeed's default for each one not given; frozen."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", freeze(self.params))


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
                raise _auto(_join(path, key))
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
