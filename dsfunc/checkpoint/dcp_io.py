"""The calls into ``torch.distributed.checkpoint`` (DCP): every tensor file is written and read here."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dsfunc.checkpoint.coordination import side_group
from dsfunc.dist import comm

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def write_tensors(tensors: dict[str, Any], folder: Path) -> None:
    """Write this rank's ``tensors`` (DTensors and, on rank 0, plain tensors) into ``folder``, fsynced."""
    if comm.is_distributed():
        dcp.save(tensors, storage_writer=_make_writer(folder), process_group=side_group())
        return
    # One process: DCP warns that it assumes so. catch_warnings swaps the process-wide filters; in the
    # save thread of an async save that is racy only against the main thread changing filters meanwhile.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.save(tensors, storage_writer=_make_writer(folder), no_dist=True)


def read_tensors(targets: dict[str, Any], folder: Path, *, offline: bool = False) -> None:
    """Fill ``targets`` in place from ``folder``; ``offline`` reads without the process group (export)."""
    reader = dcp.FileSystemReader(str(folder))
    if comm.is_distributed() and not offline:
        dcp.load(targets, storage_reader=reader, process_group=side_group())
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.load(targets, storage_reader=reader, no_dist=True)


def _make_writer(folder: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True)


def failure_text(e: BaseException) -> str:
    """A short account of an error; DCP's per-rank failures as ``rank r: Type: message``."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}"
                         for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"
