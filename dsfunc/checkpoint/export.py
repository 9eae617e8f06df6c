"""A checkpoint's weights as one consolidated fp32 ``state_dict`` file (``dsfunc export CKPT_DIR OUT``).

``CKPT_DIR`` is a dsfunc or a DeepSpeed checkpoint (:mod:`dsfunc.checkpoint.deepspeed.weights`); with
``--hf-config DIR`` the output is a Hugging Face model directory instead (:mod:`dsfunc.checkpoint.hf`).
Both formats are one file that plain PyTorch reads, written while no more than one unit's tensors (for a
DeepSpeed checkpoint: one batch of tensors) are in memory:

* ``safetensors`` (``safetensors.torch.load_file(out)``): the header (every name, dtype, shape and
  offset) is known from the checkpoint's metadata, so it is written first and the tensor bytes are
  appended one unit at a time. Tied parameters are stored under each of their names (safetensors has
  no aliasing). The writer is our own because the safetensors library cannot stream: its
  ``serialize_file`` takes every tensor's buffer in one call (0.8; safetensors/safetensors#291).
* ``pt`` (``torch.load(out)``): the tensors are first streamed into a temporary safetensors file next to
  ``out``, which is then memory-mapped and handed to ``torch.save``: the bytes come from the page cache,
  not the heap (the mapped pages do count in the process's resident size while ``torch.save`` reads
  them; the kernel reclaims them as needed). Tied names share one tensor, as in ``model.state_dict()``.
  Needs the disk space of the weights twice while it runs.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from dsfunc.checkpoint.dcp_io import read_tensors
from dsfunc.checkpoint.deepspeed.folder import is_deepspeed_folder
from dsfunc.checkpoint.deepspeed.weights import deepspeed_weights
from dsfunc.checkpoint.metadata import read_listed_index, read_meta, verify_files
from dsfunc.checkpoint.per_param import LAYOUT
from dsfunc.checkpoint.publish import atomic_file
from dsfunc.checkpoint.schema import DTYPES
from dsfunc.checkpoint.tags import PathLike, find_checkpoint
from dsfunc.errors import InputError

Layout = Sequence[tuple[str, tuple[int, ...], torch.dtype]]

FORMATS = ("safetensors", "pt")
_SUFFIXES = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt", ".bin": "pt"}
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def export_fp32(ckpt_dir: PathLike, out: PathLike, tag: str | None = None, *,
                format: str | None = None, verify: bool = True, trust_pickle: bool = False,
                exclude_frozen: bool = False) -> str:
    """Write a checkpoint's weights as one consolidated fp32 ``state_dict`` file, offline.

    No process group is needed. The file holds every name ``model.state_dict()`` has (tied parameters
    under each of their names, persistent buffers and frozen parameters), so plain
    ``model.load_state_dict(...)`` accepts it. It is written one unit at a time: no more than one unit's
    tensors are in memory at once.

    Args:
      ckpt_dir: a ``save_dir`` of dsfunc or DeepSpeed (with ``tag`` or ``latest``) or a checkpoint folder.
      out: the output file; written to a temporary name and renamed when complete.
      tag: which checkpoint (default: ``latest``).
      format: ``"safetensors"`` (``safetensors.torch.load_file(out)``) or ``"pt"``
        (``torch.load(out)``); default from ``out``'s suffix (``.safetensors``; ``.pt``/``.pth``/``.bin``).
      verify: check the files against their recorded checksums first (DeepSpeed records none).
      trust_pickle: read the checkpoint's pickles with full unpickling, which may run code: only for a
        checkpoint whose origin you trust (see :func:`dsfunc.load_checkpoint`).
      exclude_frozen: leave out the parameters that do not train.

    Returns:
      ``out`` as a string.
    """
    fmt = format or format_from_suffix(out)
    if fmt not in FORMATS:
        raise InputError(f"format must be one of {FORMATS}, got {fmt!r}")
    aliases = fmt == "safetensors"  # safetensors stores tied names separately; torch.save shares them
    layout, order, keys, tensors = weights(ckpt_dir, tag, with_aliases=aliases, verify=verify,
                                           trust_pickle=trust_pickle, exclude_frozen=exclude_frozen)
    if fmt == "safetensors":
        write_safetensors(out, layout, tensors, order=order)
    else:
        write_torch(out, layout, tensors, keys=keys)
    return str(out)


def weights(ckpt_dir: PathLike, tag: str | None = None, *, with_aliases: bool, verify: bool = True,
            trust_pickle: bool = False,
            exclude_frozen: bool = False) -> tuple[Layout, list[str], list[tuple[str, str]], Iterator]:
    """A checkpoint's weights, streamed: ``(layout, order, keys, tensors)``.

    ``tensors`` yields ``(name, tensor)`` in ``layout``'s order (``(name, shape, dtype)``), one unit (or, for
    a DeepSpeed checkpoint, one batch) in memory at a time; ``order`` is every state dict name in the
    module's order and ``keys`` maps each to the name of the tensor it is (tied names share one). Tied names
    are yielded under each of their names with ``with_aliases``, else under the first only.
    ``exclude_frozen`` leaves out the parameters that do not train (DeepSpeed's
    ``exclude_frozen_parameters``).
    """
    folder = find_checkpoint(ckpt_dir, tag)
    if is_deepspeed_folder(folder):
        return deepspeed_weights(folder, with_aliases=with_aliases, trust_pickle=trust_pickle,
                                 exclude_frozen=exclude_frozen)
    meta = read_meta(folder)
    verify_files(folder, meta, share=(0, 1) if verify else None)
    index = read_listed_index(folder, meta, trust_pickle=trust_pickle)
    kept = _kept_buffers(folder, meta, exclude_frozen)
    layout = _export_layout(meta, kept, with_aliases=with_aliases)
    entries = [(name, kind, source) for name, kind, source in meta["state_dict"] if kind != "buffer" or name in kept]
    keys = [(name, source) for name, _, source in entries]
    order = [name for name, _ in keys] if with_aliases else [name for name, kind, source in entries
                                                             if kind == "buffer" or name == source]
    return layout, order, keys, _export_tensors(folder, meta, index, kept, with_aliases=with_aliases)


def _kept_buffers(folder: Path, meta: dict[str, Any], exclude_frozen: bool) -> list[str]:
    """The buffer entries (buffers and frozen parameters) to export, in the module's order."""
    names = [name for name, kind, _ in meta["state_dict"] if kind == "buffer"]
    if not exclude_frozen:
        return names
    if any("frozen" not in meta["buffers"][name] for name in names):
        raise InputError(f"{folder} does not record which of its tensors are frozen parameters (it was written "
                         f"by dsfunc {meta.get('dsfunc_version')}): export it without excluding them")
    return [name for name in names if not meta["buffers"][name]["frozen"]]


def _export_layout(meta: dict[str, Any], kept: list[str], *, with_aliases: bool) -> Layout:
    """``(name, shape, dtype)`` of each exported tensor, in the order :func:`_export_tensors` yields them."""
    layout = []
    for unit in meta["units"]:
        for p in unit["params"]:
            for name in p["aliases"] if with_aliases else [p["name"]]:
                layout.append((name, tuple(p["shape"]), torch.float32))
    for name in kept:
        b = meta["buffers"][name]
        layout.append((name, tuple(b["shape"]), DTYPES[b["dtype"]]))
    return layout


def _export_tensors(folder: Path, meta: dict[str, Any], index: Metadata, kept: list[str], *,
                    with_aliases: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the checkpoint one unit (then one buffer) at a time, yielding named tensors; a per-parameter
    checkpoint (:mod:`.per_param`) one parameter at a time."""
    per_param = meta.get("layout") == LAYOUT
    for unit in meta["units"]:
        flat = torch.empty(unit["numel"], dtype=torch.float32)
        views = [flat[p["offset"] : p["offset"] + math.prod(p["shape"])].view(p["shape"]) for p in unit["params"]]
        read_tensors({f"params/{p['name']}": view for p, view in zip(unit["params"], views)} if per_param
                     else {f"params/{unit['name']}": flat}, folder, index, offline=True)
        for p, view in zip(unit["params"], views):
            for name in p["aliases"] if with_aliases else [p["name"]]:
                yield name, view
        del flat, views
    for name in kept:
        b = meta["buffers"][name]
        t = torch.empty(b["shape"], dtype=DTYPES[b["dtype"]])
        read_tensors({f"buffers/{name}": t}, folder, index, offline=True)
        yield name, t


def format_from_suffix(out: str | os.PathLike) -> str:
    """``"safetensors"`` or ``"pt"`` from the output file's suffix, or an error asking for ``--format``."""
    suffix = Path(out).suffix.lower()
    if suffix not in _SUFFIXES:
        raise InputError(
            f"cannot tell the format from the file name {str(out)!r}: name it *.safetensors or *.pt "
            f"(.pth, .bin), or pass format= / --format ({' or '.join(FORMATS)})"
        )
    return _SUFFIXES[suffix]


def write_safetensors(out: str | os.PathLike, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]],
                      order: Sequence[str] | None = None) -> None:
    """Stream ``tensors`` (yielded in ``layout`` order) into a safetensors file at ``out``.

    ``order`` is the order of names in the header (default: ``layout``'s); the data follows ``layout``.
    The file appears at ``out`` only once complete.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, offset = {}, 0
    for name, shape, dtype in layout:
        size = math.prod(shape) * dtype.itemsize
        offsets[name] = {"dtype": _st_dtype(dtype, name), "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    for name in order if order is not None else [n for n, _, _ in layout]:
        header[name] = offsets[name]
    if set(header) - {"__metadata__"} != set(offsets):
        raise InputError("write_safetensors: order must name every tensor of the layout exactly once")
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with atomic_file(out) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        produced = iter(tensors)
        for name, shape, dtype in layout:
            got_name, t = next(produced)
            if got_name != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise InputError(f"write_safetensors: expected {name} {tuple(shape)} {dtype}, "
                                 f"got {got_name} {tuple(t.shape)} {t.dtype}")
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)


def write_torch(out: str | os.PathLike, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]],
                keys: Sequence[tuple[str, str]]) -> None:
    """Stream ``tensors`` into a ``torch.save`` file at ``out`` holding ``{key: tensor[source]}`` for
    ``(key, source)`` in ``keys`` (several keys may share a source: tied parameters)."""
    staging = Path(f"{out}.staging-{os.getpid()}.safetensors")
    try:
        write_safetensors(staging, layout, tensors)
        with atomic_file(out) as tmp:
            _save_mapped(staging, layout, keys, tmp)
    finally:
        staging.unlink(missing_ok=True)


def _save_mapped(staging: Path, layout: Layout, keys: Sequence[tuple[str, str]], out: Path) -> None:
    """``torch.save`` the tensors of a safetensors file, read through a memory map (freed on return)."""
    with open(staging, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view: no torch warning
    (length,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + length])
    loaded = {}
    for name, shape, dtype in layout:
        begin, end = header[name]["data_offsets"]
        if end == begin:
            loaded[name] = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(mapped, dtype=dtype, count=math.prod(shape), offset=8 + length + begin)
            loaded[name] = flat.view(shape)
    torch.save({key: loaded[source] for key, source in keys}, out)


def _st_dtype(dtype: torch.dtype, name: str) -> str:
    if dtype not in _ST_DTYPES:
        raise InputError(f"{name}: safetensors cannot store dtype {dtype}")
    return _ST_DTYPES[dtype]
