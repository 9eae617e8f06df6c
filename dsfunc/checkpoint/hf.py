"""``dsfunc export CKPT_DIR OUT --hf-config DIR``: a Hugging Face model directory from a dsfunc or DeepSpeed checkpoint.

The directory ``AutoModel*.from_pretrained(OUT)`` loads: the checkpoint's fp32 weights under the model's
own names in ``model.safetensors`` — or, past ``max_shard_size``, in ``model-00001-of-0000N.safetensors``
... — with ``model.safetensors.index.json`` mapping every name to its file (written in both cases), and the
``config.json`` (plus ``generation_config.json`` if there is one) copied from ``--hf-config``: a checkpoint
holds weights, not the model's architecture, so the user supplies it (``model.config.save_pretrained(DIR)``
writes one; a model from the Hub has one in its snapshot). As ``save_pretrained`` does, tied weights are
written once, under their first name; ``from_pretrained`` ties the others back.

The shards are streamed one tensor at a time (:func:`dsfunc.checkpoint.export.weights`), and the directory
appears at ``OUT`` only once complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from dsfunc.checkpoint.export import Layout, weights, write_safetensors
from dsfunc.checkpoint.tags import PathLike
from dsfunc.errors import InputError

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
DEFAULT_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def export_hf(ckpt_dir: PathLike, out_dir: PathLike, hf_config: PathLike, tag: str | None = None, *,
              max_shard_size: int | str = DEFAULT_SHARD_SIZE, verify: bool = True,
              trust_pickle: bool = False) -> str:
    """Write a Hugging Face model directory at ``out_dir`` from a dsfunc or DeepSpeed checkpoint.

    Args:
      ckpt_dir: a ``save_dir`` of dsfunc or DeepSpeed (with ``tag`` or ``latest``), or a checkpoint folder.
      out_dir: the directory to create (it must not exist, or be empty).
      hf_config: a directory holding the model's ``config.json`` (``model.config.save_pretrained(dir)``).
      tag: which checkpoint (default: ``latest``).
      max_shard_size: bytes per safetensors file, or a size such as ``"5GB"``/``"500MiB"``; a tensor larger
        than that gets a file of its own.
      verify, trust_pickle: as for :func:`dsfunc.checkpoint.export_fp32`.

    Returns:
      ``out_dir`` as a string.
    """
    config = Path(hf_config)
    if not (config / "config.json").is_file():
        raise InputError(f"{config} has no config.json: pass the directory model.config.save_pretrained(...) "
                         "wrote (or a Hugging Face snapshot of the model)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} already exists and is not an empty directory: remove it or choose another")
    limit = parse_size(max_shard_size)
    layout, order, _, tensors = weights(ckpt_dir, tag, with_aliases=False, verify=verify,
                                        trust_pickle=trust_pickle)
    staging = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    staging.mkdir(parents=True)
    try:
        parts = shards(layout, limit)
        files = [("model.safetensors" if len(parts) == 1 else
                  f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors") for i in range(len(parts))]
        weight_map = {}
        for file, shard in zip(files, parts):
            names = {name for name, _, _ in shard}
            write_safetensors(staging / file, shard, take(tensors, len(shard)),
                              order=[n for n in order if n in names])
            weight_map.update({name: file for name in names})
        total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in layout)
        index = {"metadata": {"total_size": total}, "weight_map": {n: weight_map[n] for n in order}}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for name in CONFIG_FILES:
            if (config / name).is_file():
                shutil.copyfile(config / name, staging / name)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(out)


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size like ``"5GB"`` (decimal units, as Hugging Face) or ``"512MiB"``."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if m is None:
            raise InputError(f"cannot read the size {size!r}: write bytes, or e.g. 5GB, 500MB, 512MiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value <= 0:
        raise InputError(f"the shard size must be > 0 bytes, got {size!r}")
    return value


def shards(layout: Layout, limit: int) -> list[list]:
    """Consecutive runs of ``layout`` of at most ``limit`` bytes each (a larger tensor alone)."""
    parts: list[list] = [[]]
    size = 0
    for entry in layout:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if parts[-1] and size + nbytes > limit:
            parts.append([])
            size = 0
        parts[-1].append(entry)
        size += nbytes
    return parts


def take(tensors: Iterator[tuple[str, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    for _ in range(n):
        yield next(tensors)
