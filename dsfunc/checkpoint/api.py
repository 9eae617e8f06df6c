"""Checkpoints: atomic, resharding saves and loads of a :class:`~dsfunc.TrainState`, and fp32 export.

Layout of ``save_dir`` (every rank writes its own tensor file; one job per ``save_dir``)::

    save_dir/latest                          the newest tag (text, no newline), replaced atomically
    save_dir/<tag>/.metadata                 torch.distributed.checkpoint's index of the tensors
    save_dir/<tag>/__<r>_0.distcp            tensor data written by rank r
    save_dir/<tag>/client_state.pt           rank 0's ``client_state`` (torch.save pickle)
    save_dir/<tag>/dsfunc_checkpoint.json    what was saved, with every file's size and sha256

**Resharding.** Tensors are stored under names and global shapes that do not depend on the world size:
each unit's fp32 master weights as one flat vector of its *unpadded* length, a DTensor sharded on dim 0
exactly as ``torch.chunk`` splits it (each rank writes its own slice; at stage 0 each rank writes its
``torch.chunk`` slice of its full copy); every optimizer-state leaf shaped like a unit the same way; and
everything else (step, optimizer counters, loss scaler, dropout seed, metrics, buffers) once, from rank 0.
A load reads the slices it needs, so any world size and ZeRO stage loads any checkpoint, and the fp32
masters make fp16/bf16/fp32 runs interchangeable (the loss-scaler state is kept only when the precision
and the kind of scaler are unchanged).

**Atomicity.** Ranks write into ``save_dir/.<tag>.tmp-<id>``; once every rank's files are on disk and
checksummed, rank 0 writes ``dsfunc_checkpoint.json`` last, renames the folder to ``<tag>`` (an existing
``<tag>`` is first renamed to ``.<tag>.replaced`` and removed only after the new one is in place) and
then replaces ``latest`` (write + fsync + ``os.replace``). A save that dies part-way leaves the previous
checkpoint and ``latest`` as they were; a folder without ``dsfunc_checkpoint.json`` is never loaded.

**Every rank must call** :func:`save_checkpoint` and :func:`load_checkpoint` with the same tag. Ranks meet
through the process group's store before anything else: one that does not arrive within ``timeout``
seconds is named in a :class:`CheckpointTimeoutError` on every rank that did, instead of a hang. After
that, checkpoint traffic runs on a gloo side group, never on the training group.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import io
import itertools
import json
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dsfunc.dist import comm
from dsfunc.state import TrainState

T = TypeVar("T")
PathLike = str | os.PathLike

META_FILE = "dsfunc_checkpoint.json"
CLIENT_FILE = "client_state.pt"
LATEST_FILE = "latest"
FORMAT = "dsfunc.checkpoint"
FORMAT_VERSION = 1
DEFAULT_TIMEOUT = 300.0  # seconds every rank gets to arrive at a save or load
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what to do."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint at the given directory and tag."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or changed since it was written."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the template state (model, unit layout or optimizer)."""


class CheckpointTimeoutError(CheckpointError):
    """Not every rank called save/load within the timeout."""


_ERRORS = {cls.__name__: cls for cls in (CheckpointError, CheckpointNotFoundError, CheckpointCorruptError,
                                         CheckpointMismatchError, CheckpointTimeoutError)}


# --------------------------------------------------------------------------------------------------
# public API


def save_checkpoint(
    state: TrainState,
    save_dir: PathLike,
    tag: str | None = None,
    client_state: Any = None,
    save_latest: bool = True,
    *,
    async_save: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> str:
    """Save ``state`` to ``save_dir/<tag>/``; every rank must call it.

    Args:
      state: the training state (not consumed).
      save_dir: the checkpoint directory (created if needed; shared by all ranks).
      tag: the checkpoint's folder name (default ``global_step<N>``, N = ``int(state.step)``). Saving
        over an existing tag replaces it only once the new checkpoint is complete.
      client_state: anything ``torch.save`` can pickle (rank 0's is kept, as it is at this call),
        returned by the load.
      save_latest: also point ``save_dir/latest`` at this tag.
      async_save: copy the state to host memory, return, and write in a background thread while
        training continues. One save is in flight at most: the next save or load (or
        :func:`wait_for_checkpoint`) waits for it and raises if it failed.
      timeout: seconds to wait for every rank to arrive before raising :class:`CheckpointTimeoutError`.

    Returns:
      The checkpoint folder ``save_dir/<tag>`` (for an async save: where it will be once written).
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save_checkpoint expects a TrainState from dsfunc.init_state, got "
                        f"{type(state).__name__}")
    state.check_usable()
    if not save_dir:
        raise ValueError("save_dir is empty: pass the directory to write checkpoints into")
    tag = _check_tag(str(tag) if tag is not None else f"global_step{int(state.step)}")
    wait_for_checkpoint()
    _arrive("save_checkpoint", tag, timeout)
    meta = _describe(state, tag)
    client = _collective(lambda: _pickle(client_state) if comm.rank() == 0 else None)
    tensors = _save_dict(state, staged=async_save)
    job = functools.partial(_write, Path(save_dir), tag, tensors, meta, client, save_latest)
    if not async_save:
        return job()
    global _PENDING
    _PENDING = _executor().submit(job)
    return str(Path(save_dir) / tag)


def load_checkpoint(
    load_dir: PathLike,
    state: TrainState,
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    verify: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[TrainState, Any]:
    """Load a checkpoint into the template ``state``; every rank must call it.

    The template is a fresh :func:`dsfunc.init_state` of the same model at any world size, ZeRO stage
    or precision; it is donated (its tensors are filled in place and belong to the returned state).

    Args:
      load_dir: the ``save_dir`` of :func:`save_checkpoint` (or a checkpoint folder itself).
      state: the template state.
      tag: which checkpoint (default: the one ``load_dir/latest`` names).
      load_optimizer_states: ``False`` keeps the template's fresh optimizer state (and so restarts
        the LR schedule, whose step count lives there): for a run with another optimizer.
      verify: check every file against the sha256 recorded at save (spread over the ranks); sizes are
        always checked.
      timeout: seconds to wait for every rank to arrive before raising :class:`CheckpointTimeoutError`.

    Returns:
      ``(new_state, client_state)``. The client state is unpickled: load only checkpoints you trust,
      as with ``torch.load``.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"load_checkpoint expects a TrainState from dsfunc.init_state, got "
                        f"{type(state).__name__}")
    state.check_usable()
    wait_for_checkpoint()
    _arrive("load_checkpoint", None if tag is None else str(tag), timeout)
    folder, meta, client = _collective(
        lambda: _open(Path(load_dir), tag, state, load_optimizer_states, verify))
    targets, copy_back = _load_dict(state, _wanted(meta, state, load_optimizer_states))
    try:
        _dcp_load(targets, folder)
        with torch.no_grad():
            for device_view, host in copy_back:
                device_view.copy_(host)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        state.mark_donated()
        raise CheckpointError(
            f"reading the tensors of {folder} failed: {_failure_text(e)}. The template state was partly "
            "overwritten and is consumed; build a fresh one with dsfunc.init_state before trying again."
        ) from e
    new = dataclasses.replace(state)
    state.mark_donated()
    new.program.workspace.refresh(new.params)
    return new, client


def wait_for_checkpoint() -> str | None:
    """Wait for the asynchronous save in flight, if any; return its folder, or raise why it failed.

    Every rank should call it before ``destroy_process_group`` (the save's ranks talk to each other).
    """
    global _PENDING
    pending, _PENDING = _PENDING, None
    return None if pending is None else pending.result()


def available_tags(save_dir: PathLike) -> list[str]:
    """Tags of the complete checkpoints in ``save_dir``, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if not p.name.startswith(".") and (p / META_FILE).is_file()]
    return [p.name for p in sorted(found, key=lambda p: (p / META_FILE).stat().st_mtime)]


def export_fp32(ckpt_dir: PathLike, out: PathLike, tag: str | None = None, *,
                format: str | None = None, verify: bool = True) -> str:
    """Write a checkpoint's weights as one consolidated fp32 ``state_dict`` file, offline.

    No process group is needed. The file holds every name ``model.state_dict()`` has (tied parameters
    under each of their names, persistent buffers and frozen parameters), so plain
    ``model.load_state_dict(...)`` accepts it. It is written one unit at a time: no more than one unit's
    tensors are in memory at once.

    Args:
      ckpt_dir: a ``save_dir`` (with ``tag`` or ``latest``) or a checkpoint folder.
      out: the output file; written to a temporary name and renamed when complete.
      tag: which checkpoint (default: ``latest``).
      format: ``"safetensors"`` (``safetensors.torch.load_file(out)``) or ``"pt"``
        (``torch.load(out)``); default from ``out``'s suffix (``.safetensors``; ``.pt``/``.pth``/``.bin``).
      verify: check the files against their recorded checksums first.

    Returns:
      ``out`` as a string.
    """
    from dsfunc.checkpoint import export  # export's CLI imports this module

    fmt = format or export.format_from_suffix(out)
    if fmt not in export.FORMATS:
        raise ValueError(f"format must be one of {export.FORMATS}, got {fmt!r}")
    folder = _resolve(Path(ckpt_dir), tag)
    meta = _read_meta(folder)
    _verify_files(folder, meta, share=(0, 1) if verify else None)
    aliases = fmt == "safetensors"  # safetensors stores tied names separately; torch.save shares them
    layout = _export_layout(meta, with_aliases=aliases)
    tensors = _export_tensors(folder, meta, with_aliases=aliases)
    if fmt == "safetensors":
        export.write_safetensors(out, layout, tensors, order=[name for name, _, _ in meta["state_dict"]])
    else:
        keys = [(name, source) for name, _, source in meta["state_dict"]]
        export.write_torch(out, layout, tensors, keys=keys)
    return str(out)


# --------------------------------------------------------------------------------------------------
# what a state holds, by checkpoint key


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of a state: its key, this rank's tensor, and the unit it is laid out like (or None)."""

    key: str
    tensor: torch.Tensor
    unit: str | None


def _entries(state: TrainState) -> list[_Entry]:
    """Every tensor of ``state`` under a world-size-independent key (the same on every rank)."""
    params = state.params
    out = [_Entry("step", state.step, None), _Entry("rng", state.rng, None)]
    out += [_Entry(f"params/{name}", t, name) for name, t in params.items()]
    for key, accessor, leaf in _leaves("optim", state.opt_state):
        last = accessor[-1] if len(accessor) else None
        unit = last.entry if isinstance(last, optree.MappingEntry) else None
        shaped = unit in params and leaf.shape == params[unit].shape
        out.append(_Entry(key, leaf, unit if shaped else None))
    out += [_Entry(key, leaf, None) for key, _, leaf in _leaves("scaler", state.scaler)]
    out += [_Entry(key, leaf, None) for key, _, leaf in _leaves("metrics", state.metrics)]
    out += [_Entry(f"buffers/{name}", t, None) for name, t in state.buffers.items()]
    return out


def _leaves(prefix: str, tree: Any) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """``(key, accessor, leaf)``, keys like ``optim/optimizer/adam/mu/root`` (field names, not indices)."""
    named = (optree.NamedTupleEntry, optree.DataclassEntry)
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree)
    for accessor, leaf in zip(accessors, leaves):
        names = [str(e.field) if isinstance(e, named) else str(e.entry) for e in accessor]
        yield "/".join([prefix, *names]), accessor, leaf


def _chunk(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` of ``numel`` elements split like ``torch.chunk`` (may be empty)."""
    size = -(-numel // world)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def _save_dict(state: TrainState, *, staged: bool) -> dict[str, Any]:
    """What this rank hands to DCP: its slice of every unit-shaped tensor, and (rank 0) the rest.

    ``staged`` copies everything to host memory so training may go on while a thread writes it. GPU
    tensors always go through host memory: DCP then coordinates on the gloo side group with CPU
    tensors only.
    """
    plan, world, rank = state.program.plan, comm.world_size(), comm.rank()
    copy = (lambda t: t.detach().to("cpu", copy=True)) if staged else (lambda t: t.detach().cpu())
    out: dict[str, Any] = {}
    for e in _entries(state):
        if e.unit is None:
            if rank == 0:
                out[e.key] = copy(e.tensor)
            continue
        numel = plan.unit(e.unit).numel
        if world == 1:
            out[e.key] = copy(e.tensor[:numel])
            continue
        start, stop = _chunk(numel, world, rank)
        local = e.tensor[: stop - start] if plan.ways > 1 else e.tensor[start:stop]
        local = copy(local)
        out[e.key] = DTensor.from_local(local, _mesh(local.device.type), [Shard(0)], shape=(numel,),
                                        stride=(1,), run_check=False)
    return out


def _load_dict(
    state: TrainState, wanted: set[str]
) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """DCP targets that are views of the template's own CPU tensors, so the load fills them in place;
    GPU tensors get a host buffer, returned as ``(device view, host buffer)`` pairs to copy back."""
    plan = state.program.plan
    out: dict[str, Any] = {}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_host(view: torch.Tensor) -> torch.Tensor:
        if view.device.type == "cpu":
            return view
        host = torch.empty_like(view, device="cpu")
        copy_back.append((view, host))
        return host

    for e in _entries(state):
        if e.key not in wanted:
            continue
        if e.unit is None or plan.ways == 1:
            out[e.key] = on_host(e.tensor)
            continue
        unit = plan.unit(e.unit)
        start, stop = plan.local_range(unit)
        e.tensor[stop - start:].zero_()  # the padding tail stays zero
        out[e.key] = DTensor.from_local(on_host(e.tensor[: stop - start]), _mesh("cpu"), [Shard(0)],
                                        shape=(unit.numel,), stride=(1,), run_check=False)
    return out, copy_back


def _describe(state: TrainState, tag: str) -> dict[str, Any]:
    """The metadata file's content (files and checksums are added once written)."""
    import dsfunc

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
    for e in _entries(state):
        shape = [plan.unit(e.unit).numel] if e.unit is not None else list(e.tensor.shape)
        tensors[e.key] = {"unit": e.unit, "shape": shape, "dtype": _dtype_name(e.tensor.dtype)}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "step": int(state.step),
        "world_size": comm.world_size(),
        "zero_stage": plan.stage,
        "precision": _precision(state),
        "optimizer": cfg.optimizer.type if cfg.optimizer is not None else None,
        "scaler": dataclasses.asdict(program.scaler),
        "dsfunc_version": dsfunc.__version__,
        "torch_version": torch.__version__,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "units": [
            {"name": u.name, "numel": u.numel,
             "params": [{"name": s.name, "shape": list(s.shape), "offset": s.offset,
                         "aliases": list(s.aliases)} for s in u.params]}
            for u in plan.units
        ],
        "buffers": {name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
                    for name, t in state.buffers.items()},
        "state_dict": state_dict,
        "tensors": tensors,
        "config": json.loads(json.dumps(_thaw(cfg.raw), default=str)),
    }


def _precision(state: TrainState) -> str:
    cfg = state.program.config
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def _pickle(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save({} if obj is None else obj, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------------
# saving


def _make_writer(folder: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True)


def _write(save_dir: Path, tag: str, tensors: dict[str, Any], meta: dict[str, Any], client: bytes | None,
           save_latest: bool) -> str:
    """Write, verify and publish one checkpoint (runs on every rank, maybe in the save thread)."""
    rank, tmp = comm.rank(), None
    try:
        tmp = Path(_collective(lambda: _make_tmp(save_dir, tag) if rank == 0 else None, src=0))
        try:
            _dcp_save(tensors, tmp)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"writing the tensors failed: {_failure_text(e)}") from e
        digests: dict[str, Any] = {}
        for part in _collective(lambda: _hash_share(tmp), gather=True):
            digests.update(part)
        _collective(lambda: _publish(save_dir, tmp, tag, {**meta, "files": digests}, client, save_latest)
                    if rank == 0 else None)
    except Exception as e:
        if rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = _read_latest(save_dir)
        kept = f"`latest` still names {latest!r}" if latest else "no `latest` was written"
        cause = str(e) if isinstance(e, CheckpointError) else _failure_text(e)
        cls = type(e) if isinstance(e, CheckpointError) else CheckpointError
        raise cls(f"saving checkpoint {tag!r} to {save_dir} failed: {cause}. Nothing was replaced: {kept}, "
                  "and earlier checkpoints are intact.") from e
    return str(save_dir / tag)


def _make_tmp(save_dir: Path, tag: str) -> str:
    """(rank 0) Create the folder the ranks write into, after tidying what crashed saves left behind."""
    save_dir.mkdir(parents=True, exist_ok=True)
    for old in save_dir.glob(".*.replaced"):
        _recover(save_dir, old.name[1 : -len(".replaced")])
    for stale in save_dir.glob(".*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = save_dir / f".{tag}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return str(tmp)


def _recover(save_dir: Path, tag: str) -> None:
    """Undo a save of ``tag`` that died between moving the old folder aside and moving the new one in."""
    old, final = save_dir / f".{tag}.replaced", save_dir / tag
    if (final / META_FILE).is_file() or not (old / META_FILE).is_file():
        shutil.rmtree(old)
        return
    if final.exists():
        shutil.rmtree(final)
    os.rename(old, final)


def _hash_share(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of this rank's share of the files in ``folder``."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return {name: _digest(folder / name) for name in names[comm.rank()::comm.world_size()]}


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _publish(save_dir: Path, tmp: Path, tag: str, meta: dict[str, Any], client: bytes | None,
             save_latest: bool) -> None:
    """(rank 0) Complete the folder, move it into place, then point ``latest`` at it."""
    if client is not None:
        _write_durably(tmp / CLIENT_FILE, client)
        meta["files"][CLIENT_FILE] = _digest(tmp / CLIENT_FILE)
    _write_durably(tmp / META_FILE, json.dumps(meta, indent=1).encode())  # last: marks the folder complete
    _fsync_dir(tmp)
    final = save_dir / tag
    if final.exists():
        old = save_dir / f".{tag}.replaced"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(save_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(save_dir)
    if save_latest:
        pending = save_dir / f".{LATEST_FILE}.tmp-{uuid.uuid4().hex[:12]}"
        _write_durably(pending, tag.encode())
        os.replace(pending, save_dir / LATEST_FILE)
        _fsync_dir(save_dir)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_latest(save_dir: Path) -> str | None:
    try:
        return (save_dir / LATEST_FILE).read_text().strip() or None
    except OSError:
        return None


def _check_tag(tag: str) -> str:
    if not tag or tag.startswith(".") or tag == LATEST_FILE or any(c in tag for c in ("/", os.sep, "\0")):
        raise ValueError(
            f"invalid checkpoint tag {tag!r}: a tag is a folder name inside save_dir; it must be non-empty, "
            f"must not start with '.', contain '/' or be {LATEST_FILE!r}"
        )
    return tag


# --------------------------------------------------------------------------------------------------
# loading


def _open(load_dir: Path, tag: Any, state: TrainState, load_optimizer: bool,
          verify: bool) -> tuple[Path, dict[str, Any], Any]:
    """Find, read, check and verify the checkpoint; read its client state (before touching the template)."""
    folder = _resolve(load_dir, tag)
    meta = _read_meta(folder)
    _check_compatible(folder, meta, state, load_optimizer)
    _verify_files(folder, meta, share=(comm.rank(), comm.world_size()) if verify else None)
    client = torch.load(folder / CLIENT_FILE, weights_only=False) if CLIENT_FILE in meta["files"] else {}
    return folder, meta, client


def _wanted(meta: dict[str, Any], state: TrainState, load_optimizer: bool) -> set[str]:
    """The template's keys to read: all, but the optimizer state only if asked, the loss-scaler state only
    for the same precision and kind of scaler, and metrics only those the checkpoint has."""
    same_precision = meta["precision"] == _precision(state)
    load_scaler = same_precision and meta["scaler"]["dynamic"] == state.program.scaler.dynamic
    wanted = set()
    for e in _entries(state):
        skip = ((e.key.startswith("optim/") and not load_optimizer)
                or (e.key.startswith("scaler/") and not load_scaler)
                or (e.key.startswith("metrics/") and e.key not in meta["tensors"]))
        if not skip:
            wanted.add(e.key)
    return wanted


def _resolve(load_dir: Path, tag: Any) -> Path:
    """The folder of a complete checkpoint, or an error that lists what is there."""
    if tag is None and (load_dir / META_FILE).is_file():
        return load_dir  # a checkpoint folder itself
    if not load_dir.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} does not exist")
    tags = available_tags(load_dir)
    listing = (f"complete checkpoints there: {', '.join(map(repr, tags))}" if tags
               else "it holds no complete checkpoint")
    source = ""
    if tag is None:
        tag = _read_latest(load_dir)
        if tag is None:
            raise CheckpointNotFoundError(
                f"no `{LATEST_FILE}` file in {load_dir} and no tag given, so there is no checkpoint to pick; "
                f"pass tag=... ({listing})"
            )
        source = f" (named by {load_dir / LATEST_FILE})"
    tag = str(tag)
    folder = load_dir / tag
    if (folder / META_FILE).is_file():
        return folder
    replaced = load_dir / f".{tag}.replaced"
    if (replaced / META_FILE).is_file():  # a save over this tag died between its two renames
        return replaced
    if not folder.exists():
        raise CheckpointNotFoundError(f"no checkpoint tagged {tag!r}{source} in {load_dir}; {listing}")
    hint = ""
    if any(folder.glob("*model_states.pt")):
        hint = " It looks like a DeepSpeed checkpoint, which dsfunc cannot read."
    raise CheckpointNotFoundError(
        f"{folder}{source} is not a complete dsfunc checkpoint: it has no {META_FILE} (a save that did not "
        f"finish, or a folder not written by dsfunc.save_checkpoint).{hint} {listing[0].upper()}{listing[1:]}"
    )


def _read_meta(folder: Path) -> dict[str, Any]:
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


def _verify_files(folder: Path, meta: dict[str, Any], share: tuple[int, int] | None) -> None:
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
            if _digest(folder / name)["sha256"] != files[name]["sha256"]:
                problems.append(f"{name} does not match the sha256 recorded when it was written (corrupted)")
    if problems:
        others = [t for t in available_tags(folder.parent) if t != folder.name]
        fallback = (f"load an earlier checkpoint with tag=... ({', '.join(map(repr, others))})" if others
                    else "there is no other checkpoint next to it")
        raise CheckpointCorruptError(f"checkpoint {folder} is damaged: {'; '.join(problems)}. {fallback}")


def _check_compatible(folder: Path, meta: dict[str, Any], state: TrainState, load_optimizer: bool) -> None:
    """Raise naming every parameter, buffer or optimizer entry that differs from the template's."""
    plan = state.program.plan
    saved = {p["name"]: tuple(p["shape"]) for u in meta["units"] for p in u["params"]}
    saved.update({f"{n} (buffer)": tuple(b["shape"]) for n, b in meta["buffers"].items()})
    mine = {s.name: s.shape for u in plan.units for s in u.params}
    mine.update({f"{n} (buffer)": tuple(t.shape) for n, t in state.buffers.items()})
    lines = _differences(saved, mine, "the model")
    if lines:
        raise CheckpointMismatchError(
            f"the checkpoint {folder} does not match this model:\n" + "\n".join(lines)
            + "\nBuild the template state from the model the checkpoint was saved from."
        )
    saved_units = [(u["name"], [p["name"] for p in u["params"]]) for u in meta["units"]]
    my_units = [(u.name, [s.name for s in u.params]) for u in plan.units]
    if saved_units != my_units:
        raise CheckpointMismatchError(
            f"the checkpoint {folder} groups the parameters into units {[n for n, _ in saved_units]}, this "
            f"state into {[n for n, _ in my_units]}: pass the unit_modules the saving run used to "
            "dsfunc.init_state"
        )

    def describe(unit: str | None, shape: Any) -> str:
        return f"unit {unit}" if unit else f"shape {tuple(shape)}"

    saved_opt = {k[6:]: describe(v["unit"], v["shape"])
                 for k, v in meta["tensors"].items() if k.startswith("optim/")}
    mine_opt = {e.key[6:]: describe(e.unit, e.tensor.shape)
                for e in _entries(state) if e.key.startswith("optim/")}
    lines = _differences(saved_opt, mine_opt, "this state's optimizer")
    if lines and load_optimizer:
        cfg = state.program.config
        mine_type = cfg.optimizer.type if cfg.optimizer is not None else "a custom transform"
        raise CheckpointMismatchError(
            f"the optimizer state in {folder} (optimizer {meta['optimizer']!r}) does not fit this state's "
            f"optimizer ({mine_type!r}):\n" + "\n".join(lines) + "\nUse the optimizer the checkpoint was "
            "saved with, or pass load_optimizer_states=False to load everything else and start this "
            "optimizer fresh (its LR schedule restarts too)."
        )
    absent = sorted(_wanted(meta, state, load_optimizer) - meta["tensors"].keys())
    if absent:
        raise CheckpointMismatchError(
            f"the checkpoint {folder} (written by dsfunc {meta.get('dsfunc_version')}) has no "
            f"{', '.join(absent)}, which this state needs"
        )


def _differences(saved: Mapping[str, Any], mine: Mapping[str, Any], what: str, limit: int = 20) -> list[str]:
    def listed(names: list[str]) -> str:
        more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more

    lines = []
    if only_saved := sorted(saved.keys() - mine.keys()):
        lines.append(f"  in the checkpoint but not in {what}: {listed(only_saved)}")
    if only_mine := sorted(mine.keys() - saved.keys()):
        lines.append(f"  in {what} but not in the checkpoint: {listed(only_mine)}")
    if changed := sorted(k for k in saved.keys() & mine.keys() if saved[k] != mine[k]):
        lines.append("  different: " + listed([f"{k} (checkpoint {saved[k]}, {what} {mine[k]})"
                                                for k in changed]))
    return lines


# --------------------------------------------------------------------------------------------------
# export (offline)


def _export_layout(meta: dict[str, Any], *,
                   with_aliases: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of each exported tensor, in the order :func:`_export_tensors` yields them."""
    layout = []
    for unit in meta["units"]:
        for p in unit["params"]:
            for name in p["aliases"] if with_aliases else [p["name"]]:
                layout.append((name, tuple(p["shape"]), torch.float32))
    for name, kind, _ in meta["state_dict"]:
        if kind == "buffer":
            b = meta["buffers"][name]
            layout.append((name, tuple(b["shape"]), getattr(torch, b["dtype"])))
    return layout


def _export_tensors(folder: Path, meta: dict[str, Any], *,
                    with_aliases: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the checkpoint one unit (then one buffer) at a time, yielding named tensors."""
    for unit in meta["units"]:
        flat = torch.empty(unit["numel"], dtype=torch.float32)
        _dcp_load({f"params/{unit['name']}": flat}, folder, offline=True)
        for p in unit["params"]:
            view = flat[p["offset"] : p["offset"] + math.prod(p["shape"])].view(p["shape"])
            for name in p["aliases"] if with_aliases else [p["name"]]:
                yield name, view
        del flat
    for name, kind, _ in meta["state_dict"]:
        if kind == "buffer":
            b = meta["buffers"][name]
            t = torch.empty(b["shape"], dtype=getattr(torch, b["dtype"]))
            _dcp_load({f"buffers/{name}": t}, folder, offline=True)
            yield name, t


# --------------------------------------------------------------------------------------------------
# DCP calls


def _dcp_save(tensors: dict[str, Any], folder: Path) -> None:
    if comm.is_distributed():
        dcp.save(tensors, storage_writer=_make_writer(folder), process_group=_group())
        return
    # One process: DCP warns that it assumes so. catch_warnings swaps the process-wide filters; in the
    # save thread of an async save that is racy only against the main thread changing filters meanwhile.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.save(tensors, storage_writer=_make_writer(folder), no_dist=True)


def _dcp_load(targets: dict[str, Any], folder: Path, *, offline: bool = False) -> None:
    reader = dcp.FileSystemReader(str(folder))
    if comm.is_distributed() and not offline:
        dcp.load(targets, storage_reader=reader, process_group=_group())
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.load(targets, storage_reader=reader, no_dist=True)


def _failure_text(e: BaseException) -> str:
    """A short account of an error; DCP's per-rank failures as ``rank r: Type: message``."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}"
                         for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------------
# coordination


@dataclasses.dataclass
class _Side:
    """The gloo side group of one default process group, and DeviceMeshes over it by device type."""

    world: Any
    group: dist.ProcessGroup
    meshes: dict[str, DeviceMesh]


_SIDE: _Side | None = None
_CALLS: tuple[Any, Iterator[int]] | None = None  # (default group, count of checkpoint calls made in it)
_PENDING: Future | None = None
_EXECUTOR: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsfunc-checkpoint")
    return _EXECUTOR


def _side() -> _Side:
    global _SIDE
    world = dist.group.WORLD
    if _SIDE is None or _SIDE.world is not world:
        _SIDE = _Side(world, dist.new_group(backend="gloo"), {})
    return _SIDE


def _group() -> dist.ProcessGroup:
    return _side().group


def _mesh(device_type: str) -> DeviceMesh:
    side = _side()
    if device_type not in side.meshes:
        side.meshes[device_type] = DeviceMesh.from_group(side.group, device_type)
    return side.meshes[device_type]


def _next_call() -> int:
    """This process's number for the current checkpoint call (the same on every rank that makes it)."""
    global _CALLS
    if _CALLS is None or _CALLS[0] is not dist.group.WORLD:
        _CALLS = (dist.group.WORLD, itertools.count())
    return next(_CALLS[1])


def _arrive(op: str, tag: str | None, timeout: float) -> None:
    """Wait until every rank has called ``op`` with the same tag; raise on every rank that arrived if not.

    Each rank posts its call in the process group's store under this call's number (the count of
    checkpoint calls it made) and waits for the others' posts. Whoever finishes waiting first records
    the outcome (``ok``, or who gave up on which ranks) with an atomic compare-and-set, so a rank that
    arrives after the others gave up raises too instead of waiting for ranks that left.
    """
    if not comm.is_distributed():
        return
    world, rank = comm.world_size(), comm.rank()
    # the default group's store (no public accessor): reachable even by ranks that never call this
    store = dist.PrefixStore("dsfunc/checkpoint", dist.distributed_c10d._get_default_store())
    call = _next_call()
    keys = [f"{call}/rank{r}" for r in range(world)]
    store.set(keys[rank], json.dumps([op, tag]))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
        outcome = "ok"
    except dist.DistStoreError:
        missing = [r for r in range(world) if not store.check([keys[r]])]
        outcome = json.dumps({"rank": rank, "timeout": timeout, "missing": missing})
    decided = store.compare_set(f"{call}/outcome", "", outcome).decode()
    if decided != "ok":
        gave_up = json.loads(decided)
        missing = ", ".join(map(str, gave_up["missing"]))
        if rank in gave_up["missing"]:
            their_op, their_tag = json.loads(store.get(keys[gave_up["rank"]]))
            told = (f"rank {gave_up['rank']} called {their_op}(tag={their_tag!r}) and gave up after "
                    f"{gave_up['timeout']:g} s waiting for rank(s) {missing} of {world}; this rank's "
                    f"{op}(tag={tag!r}) came too late")
        else:
            told = (f"{op}(tag={tag!r}) waited {timeout:g} s for rank(s) {missing} of {world}, which did "
                    "not call it")
        raise CheckpointTimeoutError(
            f"{told}. Every rank must make the same checkpoint calls in the same order (a call under "
            f"`if rank == 0:` leaves the others behind); if a rank is just slow, pass a larger timeout=."
        )
    calls = [json.loads(store.get(k)) for k in keys]
    if any(c != calls[0] for c in calls):
        described = "; ".join(f"rank {r}: {o}(tag={t!r})" for r, (o, t) in enumerate(calls))
        raise CheckpointError(f"the ranks made different checkpoint calls ({described}); every rank must "
                              "make the same call with the same tag")


def _collective(fn: Callable[[], T], *, src: int | None = None, gather: bool = False) -> Any:
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (the failing rank's error class).

    Returns this rank's result, rank ``src``'s (``src=``), or every rank's in a list (``gather=True``).
    """
    error: Exception | None = None
    try:
        result, failure = fn(), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank learns of it below and raises
        error, result = e, None
        failure = (type(e).__name__, str(e)) if isinstance(e, CheckpointError) else \
            ("CheckpointError", f"{type(e).__name__}: {e}")
    if comm.is_distributed():
        replies: list[Any] = [None] * comm.world_size()
        shared = result if src is not None or gather else None
        dist.all_gather_object(replies, (shared, failure), group=_group())
    else:
        replies = [(result, failure)]
    failed = {r: f for r, (_, f) in enumerate(replies) if f is not None}
    if failed:
        messages = {m for _, m in failed.values()}
        text = (messages.pop() if len(messages) == 1
                else "; ".join(f"rank {r}: {m}" for r, (_, m) in failed.items()))
        raise _ERRORS[next(iter(failed.values()))[0]](text) from error
    if gather:
        return [r for r, _ in replies]
    return replies[src][0] if src is not None else result
