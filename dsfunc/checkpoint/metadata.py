"""The metadata file (``dsfunc_checkpoint.json``): what it records, reading it, and checking the files
against the sizes and sha256 it holds.

[Note: the manifest lists every file a load reads]
The metadata's ``files`` (the manifest) holds the size and sha256 of each file of the checkpoint. A load
reads no file the manifest does not list: DCP's ``.metadata`` and ``client_state.pt`` must be listed
(:func:`read_meta`), and so must every data file the index names before any tensor
is read (:func:`read_listed_index`). Every listed file is opened as a regular file of the folder
(:mod:`.files`), and its size is checked even with ``verify=False``.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from dsfunc.checkpoint import schema
from dsfunc.checkpoint.dcp_io import data_files, read_index
from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointError
from dsfunc.checkpoint.files import NotRegularFileError, open_regular
from dsfunc.checkpoint.keys import entries
from dsfunc.checkpoint.paths import META_DATA, META_FILE, OWNER_FILE
from dsfunc.checkpoint.per_param import LAYOUT, param_key, uses_per_param, whole_params
from dsfunc.checkpoint.tags import available_tags
from dsfunc.distributed import comm
from dsfunc.experts.placement import expert_split
from dsfunc.frozen import thaw
from dsfunc.state import TrainState
from dsfunc.version import package_version

FORMAT = "dsfunc.checkpoint"
FORMAT_VERSION = 1


def describe(state: TrainState, tag: str, *, exclude_frozen: bool = False) -> dict[str, Any]:
    """The metadata file's content (files and checksums are added once written); a pipeline stage's state
    describes the whole model (every stage's, joined), so the checkpoint is the one-stage model's.
    ``exclude_frozen``: the frozen parameters are left out of it (``buffers``, ``state_dict``, ``tensors``)."""
    meta = _describe(state, tag, exclude_frozen)
    pipeline = state.program.run.pipeline
    return meta if pipeline is None else pipeline.whole_model(meta)


def _describe(state: TrainState, tag: str, exclude_frozen: bool) -> dict[str, Any]:
    program = state.program
    plan, cfg = program.plan, program.config
    param_of = {alias: slot.name for unit in plan.units for slot in unit.params for alias in slot.aliases}
    unit_of = {alias: unit for unit in plan.units for slot in unit.params for alias in slot.aliases}
    whole = {unit.name: whole_params(state, unit) for unit in plan.units}
    experts = {unit.name for unit in plan.units if expert_split(state.program.skeleton, unit) is not None}
    kept = (set(program.persistent_buffers) | set(plan.frozen)) - (set(plan.frozen) if exclude_frozen else set())
    state_dict: list[list[str]] = []
    listed: set[str] = set()
    for key in program.skeleton.state_dict(keep_vars=True):
        if key in param_of and unit_of[key].name in experts:  # every rank's experts, where this rank's first are
            if unit_of[key].name not in listed:
                listed.add(unit_of[key].name)
                state_dict += [[a, "param", name] for name, _, aliases in whole[unit_of[key].name] for a in aliases]
        elif key in param_of:
            state_dict.append([key, "param", param_of[key]])
        elif key in kept:
            state_dict.append([key, "buffer", key])
    per_param = uses_per_param(state)
    tensors = {}
    for e in entries(state, exclude_frozen=exclude_frozen):
        dtype = _dtype_name(e.tensor.dtype)
        if e.unit is None:
            tensors[e.key] = {"unit": None, "shape": list(e.tensor.shape), "dtype": dtype}
        elif per_param:
            for name, shape, _ in whole[e.unit]:
                tensors[param_key(e.key, name)] = {"unit": e.unit, "param": name, "shape": list(shape), "dtype": dtype}
        else:
            tensors[e.key] = {"unit": e.unit, "shape": [plan.unit(e.unit).numel], "dtype": dtype}
    units = []
    for u in plan.units:
        params, offset = [], 0
        for name, shape, aliases in whole[u.name]:
            params.append({"name": name, "shape": list(shape), "offset": offset, "aliases": list(aliases)})
            offset += math.prod(shape)
        units.append({"name": u.name, "numel": offset, "params": params})
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": LAYOUT if per_param else "units",
        "tag": tag,
        "step": int(state.step),
        "world_size": comm.world_size(),
        "zero_stage": plan.stage,
        "precision": precision(state),
        "optimizer": cfg.optimizer.type if cfg.optimizer is not None else None,
        "scaler": dataclasses.asdict(program.scaler),
        "dsfunc_version": package_version(),
        "torch_version": torch.__version__,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "units": units,
        "buffers": {name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "frozen": name in plan.frozen}
                    for name, t in state.buffers.items() if not (exclude_frozen and name in plan.frozen)},
        "state_dict": state_dict,
        "tensors": tensors,
        "config": json.loads(json.dumps(thaw(cfg.raw), default=str)),
    }


def precision(state: TrainState) -> str:
    """``"fp16"``, ``"bf16"`` or ``"fp32"``: how ``state`` computes, as the metadata records it."""
    cfg = state.program.config
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_meta(folder: Path) -> dict[str, Any]:
    """The metadata of the checkpoint in ``folder``, if this dsfunc can read its format, checked to have the
    shape it writes (:func:`dsfunc.checkpoint.schema.check`)."""
    path = folder / META_FILE
    try:
        with open_regular(path) as f:
            meta = json.loads(f.read())
    except NotRegularFileError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"cannot read {path}: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path} is not dsfunc checkpoint metadata")
    version = meta.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} was written in checkpoint format {version!r} by dsfunc {meta.get('dsfunc_version')}; "
            f"this dsfunc reads format {FORMAT_VERSION}: upgrade dsfunc"
        )
    return schema.check(meta, path)


def verify_files(folder: Path, meta: dict[str, Any], share: tuple[int, int] | None) -> None:
    """Sizes of all files, and sha256 of this rank's share of them (``share=(rank, world)``), each opened as a
    regular file of ``folder`` ([Note: the manifest lists every file a load reads])."""
    files = meta["files"]
    problems = []
    for name, info in sorted(files.items()):
        try:
            with open_regular(folder / name) as f:
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
        except NotRegularFileError as e:
            problems.append(f"{name} is {e.what}, not a regular file")
        except OSError as e:
            problems.append(f"{name} cannot be read ({e.strerror})")
        else:
            if size != info["bytes"]:
                problems.append(f"{name} is {size} bytes but {info['bytes']} were written"
                                + (" (truncated)" if size < info["bytes"] else ""))
    if not problems and share is not None:
        rank, world = share
        for name in sorted(files)[rank::world]:
            if digest(folder / name)["sha256"] != files[name]["sha256"]:
                problems.append(f"{name} does not match the sha256 recorded when it was written (corrupted)")
    if problems:
        _damaged(folder, problems)


def read_listed_index(folder: Path, meta: dict[str, Any], *, trust_pickle: bool) -> Metadata:
    """DCP's index of the (verified) checkpoint in ``folder``, once the manifest is known to list every data
    file it names ([Note: the manifest lists every file a load reads])."""
    index = read_index(folder, trust_pickle=trust_pickle)
    unlisted = sorted(data_files(index) - meta["files"].keys())
    if unlisted:
        _damaged(folder, [(f"its manifest (`files` in {META_FILE}) does not list {', '.join(unlisted[:3])}, "
                           f"which {META_DATA} names as holding tensors (no tensor was read)")])
    return index


def _damaged(folder: Path, problems: list[str]) -> None:
    others = [t for t in available_tags(folder.parent) if t != folder.name]
    fallback = (f"load an earlier checkpoint with tag=... ({', '.join(map(repr, others))})" if others
                else "there is no other checkpoint next to it")
    raise CheckpointCorruptError(f"checkpoint {folder} is damaged: {'; '.join(problems)}. {fallback}")


def hash_share(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of this rank's share of the files in ``folder`` (a save's, whose claim is not one)."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != OWNER_FILE)
    return {name: digest(folder / name) for name in names[comm.rank()::comm.world_size()]}


def digest(path: Path) -> dict[str, Any]:
    """The ``files`` entry of the regular file ``path``: its size and sha256."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
        size = os.fstat(f.fileno()).st_size
    return {"bytes": size, "sha256": h.hexdigest()}
