"""``ConfigError`` and the wording its messages share: key paths, values as JSON, suggestions."""

from __future__ import annotations

import difflib
import json
from typing import Any

from dsfunc.errors import Error
from dsfunc.frozen import thaw


class ConfigError(Error, ValueError):
    """A problem in a DeepSpeed/dsfunc config; the message names the key path and what is allowed."""


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


def _auto(path: str) -> ConfigError:
    return ConfigError(f'{path} = "auto": {_AUTO_HELP}.')


def _unsupported(path: str, value: Any, feature: str, *advice: str) -> ConfigError:
    """``path`` asks for a DeepSpeed feature dsfunc lacks; ``advice`` says how to leave it off."""
    return ConfigError(
        f"{path} = {_show(value)}: dsfunc does not support {feature} yet. " + " ".join(a for a in advice if a)
    )


def _or(items: list[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"
