"""A DeepSpeed checkpoint's weights by name, streamed, for ``dsfunc export``: no template state, no process group.

The names and their order are the module's state dict as DeepSpeed saved it. Trainable parameters are
their fp32 master weights; frozen parameters (kept by DeepSpeed in the training dtype) and floating-point
buffers are widened to fp32, other buffers keep their dtype. Tied names are one tensor: with
``with_aliases`` every name is written (what ``model.load_state_dict`` wants), without it only the first
(what Hugging Face's ``save_pretrained`` writes; ``from_pretrained`` ties the others back).

The tensors are read in batches of consecutive names of at most ``batch_bytes`` (one tensor at least),
each batch with one pass over the shard files ([Note: one shard at a time] in :mod:`.shards`), so peak
memory is one batch, not the model: DeepSpeed's checkpoint has no units to go by.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from dsfunc.checkpoint.deepspeed.contents import DeepSpeedCheckpoint, open_checkpoint
from dsfunc.checkpoint.deepspeed.mapping import IMPORT_STATS
from dsfunc.checkpoint.deepspeed.shards import MASTER, Request

BATCH_BYTES = 1 << 28


def deepspeed_weights(folder: Path, *, with_aliases: bool, trust_pickle: bool = False, exclude_frozen: bool = False,
                      batch_bytes: int = BATCH_BYTES) -> tuple[list, list[str], list[tuple[str, str]], Iterator]:
    """``(layout, order, keys, tensors)`` of the DeepSpeed checkpoint in ``folder``, as
    :func:`dsfunc.checkpoint.export.write_safetensors` and ``write_torch`` take them: ``layout`` lists
    ``(name, shape, dtype)`` in the order ``tensors`` yields ``(name, tensor)``; ``order`` is every state dict
    name in the module's order; ``keys`` maps each of them to the tensor it is (``(name, source)``).
    ``exclude_frozen`` leaves out the frozen parameters."""
    ckpt = open_checkpoint(folder, trust_pickle=trust_pickle)
    index = ckpt.index
    shapes = {**index.trainable, **index.frozen, **{n: s for n, (s, _) in index.buffers.items()}}
    dtypes = {n: _exported_dtype(d) for n, (_, d) in index.buffers.items()}
    # the module's order, tied names folded into their first
    canonical = [name for name in index.aliases if not (exclude_frozen and name in index.frozen)]
    layout = [(alias, tuple(shapes[name]), dtypes.get(name, torch.float32))
              for name in canonical for alias in (index.aliases[name] if with_aliases else (name,))]
    first = {alias: name for name in canonical for alias in index.aliases[name]}
    keys = [(name, name if with_aliases else first[name]) for name in index.names if name in first]
    order = [name for name in index.names if name in first] if with_aliases else canonical
    return layout, order, keys, _tensors(ckpt, canonical, shapes, dtypes, with_aliases, batch_bytes)


def _exported_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _tensors(ckpt: DeepSpeedCheckpoint, canonical: list[str], shapes: dict, dtypes: dict, with_aliases: bool,
             batch_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    batch: list[str] = []
    size = 0
    for name in [*canonical, None]:
        nbytes = 0 if name is None else math.prod(shapes[name]) * dtypes.get(name, torch.float32).itemsize
        if batch and (name is None or size + nbytes > batch_bytes):
            yield from _read_batch(ckpt, batch, shapes, dtypes, with_aliases)
            batch, size = [], 0
        if name is not None:
            batch.append(name)
            size += nbytes


def _read_batch(ckpt: DeepSpeedCheckpoint, names: list[str], shapes: dict, dtypes: dict,
                with_aliases: bool) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = {n: torch.empty(shapes[n], dtype=dtypes.get(n, torch.float32)) for n in names}
    elements = sum(t.numel() for t in tensors.values())
    IMPORT_STATS.staged(elements)
    try:
        ckpt.index.read([Request(n, 0, t.numel(), {MASTER: t.view(-1)}) for n, t in tensors.items()])
        for name in names:
            for alias in ckpt.index.aliases[name] if with_aliases else (name,):
                yield alias, tensors[name]
    finally:
        IMPORT_STATS.freed(elements)
