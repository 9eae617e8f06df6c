"""The calls into ``torch.distributed.checkpoint`` (DCP): every tensor file is written and read here.

[Note: DCP's index under the trust rule]
``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load`` (torch 2.11-2.14), and
DCP's load planner reads any entry the index calls bytes with ``torch.load(weights_only=False)``. So the
index is read here, once, through the allow-list of what DCP's ``Metadata`` holds (:data:`DCP_GLOBALS`;
[Note: one trust rule, two unpicklers] in :mod:`.trust`), checked to list tensors only (dsfunc writes
nothing else) stored in files of the checkpoint folder, and handed to DCP by a reader that returns it
instead of reading the file again. DCP reads the tensor records themselves with
``torch.load(weights_only=True)``, each checked first by the same reader ([Note: bounded unpickling] in
:mod:`.pickle_bounds`); the index must name no transform (a decompression, which dsfunc never writes).
"""

from __future__ import annotations

import collections
import pathlib
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from dsfunc.checkpoint.coordination import collective, side_group
from dsfunc.checkpoint.disk import disk_text
from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointError
from dsfunc.checkpoint.paths import META_DATA, tensor_file
from dsfunc.checkpoint.pickle_bounds import check_torch_record
from dsfunc.checkpoint.trust import load_plain_pickle, refused_global
from dsfunc.distributed import comm


def _named(objs: list[Any]) -> dict[str, Any]:
    """``{"module.qualname": obj}``: the name pickle records for each class or function."""
    return {f"{obj.__module__}.{obj.__qualname__}": obj for obj in objs}


_PATHS = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
#: Every global a DCP ``.metadata`` of torch 2.11-2.14 may name: DCP's own dataclasses and enum, the
#: filesystem writer's storage info, torch.Size, torch.device, dtypes and layouts, builtin containers, and
#: paths (``StorageMeta.checkpoint_id``; ``pathlib._local`` from Python 3.13 on). None of them runs code
#: when called or filled in.
DCP_GLOBALS: dict[str, Any] = {
    **_named([metadata.Metadata, metadata.MetadataIndex, metadata.StorageMeta, metadata.TensorStorageMetadata,
              metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata, metadata.TensorProperties,
              metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size, torch.device,
              torch.serialization._get_layout, set, frozenset, *_PATHS]),
    **{f"pathlib.{cls.__name__}": cls for cls in _PATHS},
    "collections.OrderedDict": collections.OrderedDict,
    **{f"torch.{name}": v for name, v in vars(torch).items() if isinstance(v, (torch.dtype, torch.layout))},
}
_DCP_PLAIN = "the tensor index DCP writes: its own records, sizes, dtypes, numbers, strings and containers"

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def write_tensors(tensors: dict[str, Any], folder: Path) -> None:
    """Write this rank's ``tensors`` (DTensors and, on rank 0, plain tensors) into ``folder``, fsynced."""
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True)
    _call(dcp.save, tensors, comm.is_distributed(), storage_writer=writer)


def read_index(folder: Path, *, trust_pickle: bool = False) -> Metadata:
    """DCP's index of the tensors in ``folder`` (its ``.metadata``), read under the trust rule and checked.

    [Note: DCP's index under the trust rule]
    """
    path = folder / META_DATA
    try:
        with open(path, "rb") as f:
            index = load_plain_pickle(f, path, trust_pickle=trust_pickle, allowed=DCP_GLOBALS,
                                      plain=_DCP_PLAIN)
    except OSError as e:
        raise CheckpointCorruptError(f"cannot read {path}: {e}") from e
    except CheckpointError:
        raise
    except Exception as e:  # whatever a damaged pickle makes the unpickler raise
        raise CheckpointCorruptError(
            f"{path} is not DCP's index of the tensors: {type(e).__name__}: {e}") from e
    if not (isinstance(index, Metadata) and isinstance(index.storage_data, dict)
            and isinstance(index.state_dict_metadata, dict)):
        raise CheckpointCorruptError(f"{path} is not DCP's index of the tensors (it holds a "
                                     f"{type(index).__name__})")
    problems = [f"{key} is stored as pickled bytes" for key, md in index.state_dict_metadata.items()
                if not isinstance(md, TensorStorageMetadata)]
    problems += [f"{getattr(key, 'fqn', key)} is stored outside the folder"
                 for key, info in index.storage_data.items()
                 if not (isinstance(info, filesystem._StorageInfo) and _in_folder(info.relative_path))]
    problems += [f"{getattr(key, 'fqn', key)} is stored through the transforms {info.transform_descriptors}"
                 for key, info in index.storage_data.items() if getattr(info, "transform_descriptors", None)]
    if problems:
        raise CheckpointCorruptError(
            f"{path} does not index tensors stored in {folder}, as dsfunc writes it: "
            f"{'; '.join(problems[:3])}. The checkpoint was altered or not written by dsfunc (only the index "
            "was unpickled); load another checkpoint")
    return index


def _in_folder(name: Any) -> bool:
    """Whether ``name`` names a file of the folder itself (no directory part, no ``..``)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


class _IndexedReader(dcp.FileSystemReader):
    """DCP's file reader, handed the index that :func:`read_index` read instead of unpickling it again, and
    checking each tensor record's bounds before DCP unpickles it."""

    def __init__(self, folder: Path, index: Metadata) -> None:
        super().__init__(str(folder))
        self._index = index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._index.storage_meta is None:  # as FileSystemReader.read_metadata does
            self._index.storage_meta = StorageMeta()
        self._index.storage_meta.load_id = self.load_id
        return self._index

    def _slice_file(self, file: Any, sinfo: filesystem._StorageInfo) -> Any:
        check_torch_record(file, sinfo.offset, sinfo.length, Path(self.path) / sinfo.relative_path)
        return super()._slice_file(file, sinfo)


def read_tensors(targets: dict[str, Any], folder: Path, index: Metadata, *, offline: bool = False) -> None:
    """Fill ``targets`` in place from ``folder``, whose :func:`read_index` is ``index``; ``offline`` reads
    without the process group (export)."""
    reader = _IndexedReader(folder, index)
    try:
        _call(dcp.load, targets, comm.is_distributed() and not offline, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"reading the tensors of {folder} failed: {failure_text(e)}") from e


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
        return "; ".join(f"rank {r}: {_one(exc)}" for r, (exc, _) in sorted(e.failures.items()))
    return _one(e)


def _one(e: BaseException) -> str:
    """``Type: message``; for a tensor record that torch's weights-only unpickler refused, what it held."""
    if isinstance(e, pickle.UnpicklingError):
        found = refused_global(str(e))
        held = f"an object of class {found}" if found else "more than a tensor"
        return (f"a tensor record of the data files holds {held}, which torch.load(weights_only=True) "
                "refused (nothing of it ran): the files were altered or not written by dsfunc")
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


def data_files(index: Metadata) -> set[str]:
    """The names of the files of the folder that ``index`` (a :func:`read_index`) says hold the tensors."""
    return {info.relative_path for info in index.storage_data.values()}
