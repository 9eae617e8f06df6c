"""The calls into ``torch.distributed.checkpoint`` (DCP): every tensor file is written and read here."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dsfunc.checkpoint.coordination import collective, side_group
from dsfunc.checkpoint.disk import disk_text
from dsfunc.checkpoint.layout import META_DATA, tensor_file
from dsfunc.distributed import comm

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def write_tensors(tensors: dict[str, Any], folder: Path) -> None:
    """Write this rank's ``tensors`` (DTensors and, on rank 0, plain tensors) into ``folder``, fsynced."""
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True)
    _call(dcp.save, tensors, comm.is_distributed(), storage_writer=writer)


def read_tensors(targets: dict[str, Any], folder: Path, *, offline: bool = False) -> None:
    """Fill ``targets`` in place from ``folder``; ``offline`` reads without the process group (export)."""
    reader = dcp.FileSystemReader(str(folder))
    _call(dcp.load, targets, comm.is_distributed() and not offline, storage_reader=reader)


def _call(fn: Callable[..., Any], state_dict: dict[str, Any], distributed: bool, **storage: Any) -> None:
    """``dcp.save`` or ``dcp.load`` on the side group, or in this process alone."""
    if distributed:
        fn(state_dict, **storage, process_group=side_group())
        return
    # One process: DCP warns that it assumes so. catch_warnings swaps the process-wide filters; in the
    # save thread of an async save that is racy only against the main thread changing filters meanwhile.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        fn(state_dict, **storage, no_dist=True)


def failure_text(e: BaseException) -> str:
    """A short account of an error; DCP's per-rank failures as ``rank r: Type: message``."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}"
                         for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


def write_failure_text(e: BaseException, folder: Path) -> str:
    """Why writing into ``folder`` failed, as ``rank r: ...`` for every failed rank, the same on every rank
    (every rank must call it after a failed :func:`write_tensors`).

    Each failed rank describes its own failure, where it alone sees its disk as it was when its write
    failed, so that a full disk reads ``no space left on device while writing FOLDER/__r_0.distcp`` on
    every rank (:mod:`.disk`).
    """
    rank = comm.rank()
    if isinstance(e, CheckpointException):
        exc, frames = e.failures.get(rank, (None, []))
    else:
        exc, frames = e, []
    mine = None
    if exc is not None:
        # DCP's coordinator writes .metadata in its ``finish`` step; every rank writes its own data file
        file = META_DATA if any(f.name == "finish" for f in frames) else tensor_file(rank)
        mine = disk_text(exc, folder / file) or f"{type(exc).__name__}: {exc}"
    texts = collective(lambda: mine, gather=True)
    return "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t is not None) or failure_text(e)
