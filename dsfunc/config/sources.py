"""Where a config comes from: a dict, a JSON (or HJSON) file, base64 JSON, or an argparse namespace."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
from collections.abc import Mapping
from typing import Any

import hjson

from dsfunc.config.errors import ConfigError


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f'Duplicate key "{key}" in the config; keep one.')
        out[key] = value
    return out


def _read_file(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(
            f"Cannot read the DeepSpeed config file {os.fspath(path)!r}: {e.strerror}."
        ) from None
    try:  # HJSON, as DeepSpeed reads its files: JSON plus comments, trailing commas, unquoted keys
        data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as e:
        raise ConfigError(
            f"{os.fspath(path)}: invalid JSON (read as HJSON) at line {e.lineno}, column {e.colno}: {e.msg}."
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
        if inner is None:  # DeepSpeed's deprecated spelling, which it still reads
            inner = getattr(source, "deepscale_config", None)
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
