"""The shape of ``dsfunc_checkpoint.json``, checked once, where it is read (:func:`check`): every reader (a
load, ``dsfunc export``) then indexes it without meeting a missing key, a wrong type, a name that leaves the
folder or a size that no file of the checkpoint holds.

A file altered by hand or by another program can still be valid JSON; what it must hold is what
:func:`dsfunc.checkpoint.metadata.describe` writes, plus the manifest (``files``: every file's size and
sha256, under plain file names, listing DCP's index and the client state, which every load reads). Sizes are bounded by the bytes the manifest lists, which a load checks
against the files before reading anything, so no reader allocates more than the checkpoint holds.
"""

from __future__ import annotations

import math
import re
import reprlib
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.errors import CheckpointCorruptError
from dsfunc.checkpoint.paths import CLIENT_FILE, META_DATA

#: The dtypes a checkpoint may name, by the name the metadata records (``"float32"``).
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                                  if isinstance(d, torch.dtype)}
PRECISIONS = ("fp16", "bf16", "fp32")
LAYOUTS = ("units", "params")  # one flat vector per unit-shaped tensor, or one tensor per parameter (tp states)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class _Bad(CheckpointCorruptError):
    """What is wrong (``field``, ``problem``); reworded by :func:`check`."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field, self.problem = field, problem


def check(meta: Any, path: Path) -> dict[str, Any]:
    """``meta`` (read from ``path``) if it has the shape dsfunc writes; else an error naming the field."""
    try:
        _check(meta)
    except _Bad as e:
        raise CheckpointCorruptError(
            f"{path} is damaged: {e.field} {e.problem}. It was altered or not written by dsfunc; load another "
            "checkpoint (tag=...), or save this state again from the run that wrote it") from None
    return meta


def plain_name(name: Any) -> bool:
    """Whether ``name`` names a file of the folder itself: no directory part, not ``..``, not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def _check(meta: Any) -> None:
    _kind(meta, dict, "the file", "a JSON object")
    _count(_field(meta, "format_version", int, "", "an integer"), "format_version", 1)
    if meta.get("layout", "units") not in LAYOUTS:
        raise _Bad("layout", f"is {_short(meta['layout'])}, not one of {', '.join(LAYOUTS)}")
    for key in ("tag", "optimizer"):
        _field(meta, key, (str, type(None)) if key == "optimizer" else str, "", "a string")
    for key, least in (("step", 0), ("world_size", 1), ("zero_stage", 0)):
        _count(_field(meta, key, int, "", "an integer"), key, least)
    if _field(meta, "precision", str, "", "a string") not in PRECISIONS:
        raise _Bad("precision", f"is {meta['precision']!r}, not one of {', '.join(PRECISIONS)}")
    _field(_field(meta, "scaler", dict, "", "an object"), "dynamic", bool, "scaler.", "true or false")
    files = _field(meta, "files", dict, "", "an object")
    unlisted = [name for name in (META_DATA, CLIENT_FILE) if name not in files]
    if unlisted:
        raise _Bad("files", f"does not list {' or '.join(unlisted)}, which a load reads (nothing was read)")
    stored = 0
    for name, info in files.items():
        where = f"files[{name!r}]"
        if not plain_name(name):
            raise _Bad(where, "is not the plain name of a file in the checkpoint folder (a load reads only "
                              "files of the folder itself)")
        _kind(info, dict, where, "an object")
        stored += _count(_field(info, "bytes", int, f"{where}.", "an integer"), f"{where}.bytes", 0)
        if not _SHA256.fullmatch(_field(info, "sha256", str, f"{where}.", "a string")):
            raise _Bad(f"{where}.sha256", "is not a sha256 (64 lowercase hex digits)")
    needed = 0
    params: set[str] = set()
    units = _field(meta, "units", list, "", "a list")
    for i, unit in enumerate(units):
        where = f"units[{i}]"
        _kind(unit, dict, where, "an object")
        _field(unit, "name", str, f"{where}.", "a string")
        numel = _count(_field(unit, "numel", int, f"{where}.", "an integer"), f"{where}.numel", 0)
        needed += 4 * numel  # the fp32 master weights
        for j, p in enumerate(_field(unit, "params", list, f"{where}.", "a list")):
            at = f"{where}.params[{j}]"
            _kind(p, dict, at, "an object")
            params.add(_field(p, "name", str, f"{at}.", "a string"))
            offset = _count(_field(p, "offset", int, f"{at}.", "an integer"), f"{at}.offset", 0)
            if offset + math.prod(_shape(p, at)) > numel:
                raise _Bad(at, f"lies past the end of its unit ({numel} elements)")
            for k, alias in enumerate(_field(p, "aliases", list, f"{at}.", "a list")):
                _kind(alias, str, f"{at}.aliases[{k}]", "a string")
    buffers = _field(meta, "buffers", dict, "", "an object")
    for name, b in buffers.items():
        where = f"buffers[{name!r}]"
        _kind(b, dict, where, "an object")
        needed += math.prod(_shape(b, where)) * _dtype(b, where).itemsize
    if needed > stored:
        raise _Bad("units", f"and buffers hold {needed:,} bytes of tensors, but the files listed hold "
                            f"{stored:,} bytes in all")
    unit_names = {u["name"] for u in units}
    for key, t in _field(meta, "tensors", dict, "", "an object").items():
        where = f"tensors[{key!r}]"
        _kind(t, dict, where, "an object")
        unit = _field(t, "unit", (str, type(None)), f"{where}.", "a string or null")
        if unit is not None and unit not in unit_names:
            raise _Bad(f"{where}.unit", f"names {unit!r}, which is not among the units")
        if "param" in t and not (unit is not None and t["param"] in params and key.endswith(f"/{t['param']}")):
            raise _Bad(f"{where}.param", f"is {_short(t['param'])}, not a parameter of unit {unit!r} ending the key")
        _shape(t, where)
        _dtype(t, where)
    for i, entry in enumerate(_field(meta, "state_dict", list, "", "a list")):
        where = f"state_dict[{i}]"
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(x, str) for x in entry)):
            raise _Bad(where, "is not [name, kind, source] (three strings)")
        name, kind, source = entry
        if not (kind == "param" and source in params or kind == "buffer" and name == source and name in buffers):
            raise _Bad(where, f"names the {kind} {source!r}, which the checkpoint does not hold")


def _field(obj: dict[str, Any], key: str, kinds: type | tuple[type, ...], prefix: str, what: str) -> Any:
    if key not in obj:
        raise _Bad(f"{prefix}{key}", "is missing")
    return _kind(obj[key], kinds, f"{prefix}{key}", what)


def _kind(value: Any, kinds: type | tuple[type, ...], where: str, what: str) -> Any:
    if isinstance(value, bool) and kinds is int or not isinstance(value, kinds):
        raise _Bad(where, f"is {_short(value)}, not {what}")
    return value


def _count(value: int, where: str, least: int) -> int:
    if value < least:
        raise _Bad(where, f"is {value}, less than {least}")
    return value


def _shape(obj: dict[str, Any], where: str) -> list[int]:
    shape = _field(obj, "shape", list, f"{where}.", "a list")
    for k, size in enumerate(shape):
        _count(_kind(size, int, f"{where}.shape[{k}]", "an integer"), f"{where}.shape[{k}]", 0)
    return shape


def _dtype(obj: dict[str, Any], where: str) -> torch.dtype:
    name = _field(obj, "dtype", str, f"{where}.", "a string")
    if name not in DTYPES:
        raise _Bad(f"{where}.dtype", f"is {name!r}, not a torch dtype")
    return DTYPES[name]


def _short(value: Any) -> str:
    """``repr(value)``, a few levels and items deep (a value nested 900 deep is no error of its own)."""
    return reprlib.repr(value)
