"""The metadata file (``dsfunc_checkpoint.json``): what it records, reading it, and checking the files
against the sizes and sha256 it holds."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointError
from dsfunc.checkpoint.keys import entries
from dsfunc.checkpoint.layout import META_FILE
from dsfunc.checkpoint.tags import available_tags
from dsfunc.distributed import comm
from dsfunc.frozen import thaw
from dsfunc.state import TrainState
from dsfunc.version import package_version

FORMAT = "dsfunc.checkpoint"
FORMAT_VERSION = 1


def describe(state: TrainState, tag: str) -> dict[str, Any]:
    """The metadata file's content (files and checksums are added once written); a pipeline stage's state
    describes the whole model (every stage's, joined), so the checkpoint is the one-stage model's."""
    meta = _describe(state, tag)
    pipeline = state.program.pipeline
    return meta if pipeline is None else pipeline.whole_model(meta)


def _describe(state: TrainState, tag: str) -> dict[str, Any]:
    program = state.program
    plan, cfg = program.plan, program.config
    param_of = {alias: slot.name for unit in plan.units for slot in unit.params for alias in slot.aliases}
    kept = set(program.persistent_buffers) | set(plan.frozen)
    state_dict = []
    for key in program.skeleton.state_dict(keep_vars=True):
        if key in param_of:
            state_dict.append([key, "param", param_of[key]])
        elif key in kept:
            state_dict.append([key, "buffer", key])
    tensors = {}
    for e in entries(state):
        shape = [plan.unit(e.unit).numel] if e.unit is not None else list(e.tensor.shape)
        tensors[e.key] = {"unit": e.unit, "shape": shape, "dtype": _dtype_name(e.tensor.dtype)}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
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
        "units": [
            {"name": u.name, "numel": u.numel,
             "params": [{"name": s.name, "shape": list(s.shape), "offset": s.offset,
                         "aliases": list(s.aliases)} for s in u.params]}
            for u in plan.units
        ],
        "buffers": {name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "frozen": name in plan.frozen}
                    for name, t in state.buffers.items()},
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
    """The metadata of the checkpoint in ``folder``, if this dsfunc can read its format."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"cannot read {folder / META_FILE}: {e}") from e
    if meta.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{folder / META_FILE} is not dsfunc checkpoint metadata")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} was written in checkpoint format {meta['format_version']} by dsfunc "
            f"{meta.get('dsfunc_version')}; this dsfunc reads format {FORMAT_VERSION}: upgrade dsfunc"
        )
    return meta


def verify_files(folder: Path, meta: dict[str, Any], share: tuple[int, int] | None) -> None:
    """Sizes of all files, and sha256 of this rank's share of them (``share=(rank, world)``)."""
    problems = []
    files = meta["files"]
    for name, info in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (size := path.stat().st_size) != info["bytes"]:
            problems.append(f"{name} is {size} bytes but {info['bytes']} were written"
                            + (" (truncated)" if size < info["bytes"] else ""))
    if not problems and share is not None:
        rank, world = share
        for name in sorted(files)[rank::world]:
            if digest(folder / name)["sha256"] != files[name]["sha256"]:
                problems.append(f"{name} does not match the sha256 recorded when it was written (corrupted)")
    if problems:
        others = [t for t in available_tags(folder.parent) if t != folder.name]
        fallback = (f"load an earlier checkpoint with tag=... ({', '.join(map(repr, others))})" if others
                    else "there is no other checkpoint next to it")
        raise CheckpointCorruptError(f"checkpoint {folder} is damaged: {'; '.join(problems)}. {fallback}")


def hash_share(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of this rank's share of the files in ``folder``."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return {name: digest(folder / name) for name in names[comm.rank()::comm.world_size()]}


def digest(path: Path) -> dict[str, Any]:
    """The ``files`` entry of ``path``: its size and sha256."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}
