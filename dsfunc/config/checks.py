"""The checks and rules section tables are written with.

A check (``_bool``, ``_number(ge=0.0)``, ...) normalises the value of a key dsfunc implements; a rule
(``_only``, ``_off``, ``_empty``, ...) accepts a known DeepSpeed key only in its default or disabled form,
so that asking for a feature dsfunc lacks is an error rather than a silent no-op.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from typing import Any

from dsfunc.config.dtypes import DTYPES
from dsfunc.config.errors import ConfigError, _auto, _bad, _join, _or, _show, _unknown, _unsupported
from dsfunc.config.schema import Check, Rule, _parse, _Schema, _Spec

# Checks, for the keys dsfunc implements.


def _bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise _bad(path, value, "true or false")


def _flag(value: Any, path: str) -> bool:
    """A switch DeepSpeed reads as a truth value (``get_scalar_param``): true or false, or 1 or 0."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _bad(path, value, "true or false (or 1 or 0)")


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


def _object(value: Any, path: str) -> Mapping[str, Any]:
    """A JSON object whose contents DeepSpeed hands on unparsed (e.g. autotuning's ``arg_mappings``)."""
    if not isinstance(value, Mapping):
        raise _bad(path, value, "a JSON object")
    return value


def _list_of(inner: Check) -> Check:
    """A JSON list whose every item ``inner`` accepts."""

    def check(value: Any, path: str) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise _bad(path, value, "a list")
        return [inner(item, f"{path}[{i}]") for i, item in enumerate(value)]

    return check


def _fields(keys: Mapping[str, Check]) -> Check:
    """A JSON object (or null) with only the keys of ``keys``, each checked by its check; an unknown key is
    an error naming the closest known one (the table of a section dsfunc does not implement)."""
    schema = _Schema({key: _Spec(None, check) for key, check in keys.items()})

    def check(value: Any, path: str) -> dict[str, Any] | None:
        return None if value is None else _parse(value, path, schema)

    return check


_SIZE = _integer(ge=0, whole_floats=True)
_NON_NEGATIVE = _number(ge=0.0)
_STEPS = _integer(ge=1)


def _print_steps(value: Any, path: str) -> int | None:
    """``steps_per_print``: steps >= 1, or ``null`` or infinity (accelerate's way to turn printing off): None."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    return _STEPS(value, path)


_DTYPE_NAME = _optional(_choice(*DTYPES))
_LR = _NON_NEGATIVE


# Rules, for known DeepSpeed keys dsfunc accepts only in their default or disabled form.


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
            raise _auto(path)
        shown = _or([_show(a) for a in accepted])
        raise _unsupported(path, value, feature, f"Remove the key or set it to {shown} (DeepSpeed's default).", fix)

    return rule


def _off(feature: str, keys: Mapping[str, Check], fix: str = "") -> Rule:
    """A section dsfunc does not implement, checked against DeepSpeed's table of its keys (``enabled`` is
    added): an unknown key or a bad value is an error naming it, and ``"enabled": true`` anywhere in it is
    the not-supported error."""
    check = _fields({"enabled": _optional(_bool), **keys})

    def find_enabled(value: Any, path: str) -> str | None:
        if not isinstance(value, Mapping):
            return None
        for key, sub in value.items():
            sub_path = _join(path, key)
            found = (sub_path if sub is True else None) if key == "enabled" else find_enabled(sub, sub_path)
            if found is not None:
                return found
        return None

    def rule(value: Any, path: str) -> None:
        check(value, path)
        enabled = find_enabled(value, path)
        if enabled is not None:
            raise _unsupported(enabled, True, feature, f'Set it to false or remove "{path}".', fix)

    return rule


def _empty(feature: str) -> Rule:
    """A section accepted only when empty or null."""

    def rule(value: Any, path: str) -> None:
        if value is None or (isinstance(value, Mapping) and not value):
            return
        raise _unsupported(path, value, feature, f'Remove "{path}".')

    return rule


def _accepted(check: Check) -> Rule:
    """A key that only tunes machinery dsfunc does not have (e.g. NVMe I/O): any value ``check`` accepts."""

    def rule(value: Any, path: str) -> None:
        check(value, path)

    return rule


def _removed(message: str, see: str) -> Rule:
    """A key DeepSpeed has removed (0.19.8 refuses a config that has it), with DeepSpeed's explanation."""

    def rule(value: Any, path: str) -> None:
        raise ConfigError(f'{path}: {message} DeepSpeed 0.19.8 refuses this key too: remove "{path}" (see {see}).')

    return rule


def _reject(message: str) -> Rule:
    def rule(value: Any, path: str) -> None:
        raise ConfigError(f"{path}: {message}")

    return rule


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


def _without_effect_line(path: str, section: Any, reasons: Mapping[str, str], aliases: Mapping[str, str] = {}) -> str | None:
    """The start-up line naming the keys of a raw section (as spelled there) that ``reasons`` lists as
    without effect in dsfunc, with why; None when it sets none of them."""
    if not isinstance(section, Mapping):
        return None
    given = [key for key in section if aliases.get(key, key) in reasons]
    if not given:
        return None
    why = "; ".join(f"{key}: {reasons[aliases.get(key, key)]}" for key in given)
    verb = "has" if len(given) == 1 else "have"
    return f"{path}: {', '.join(given)} {verb} no effect in dsfunc ({why})."
