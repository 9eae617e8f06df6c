"""DeepSpeed's AutoTP checkpoints: one index of the global model from the index of each tp rank's files.

With ``tensor_parallel.autotp_size`` N, each of DeepSpeed's tp ranks saves the checkpoint of its own tp-local
module as a data-parallel one (``mp_rank_<j>_model_states.pt``, ``zero_pp_rank_<r>_mp_rank_<j>_optim_states.pt``),
and the model states record, in ``universal_checkpoint_info["affine_map"]``, where each rank's part lies in the
global parameter: its shape, and the offset and strides of its first element in the flattened global tensor
(``deepspeed/module_inject/autotp_config.py`` and ``checkpoint/``, 0.19.8). The pieces of each tp rank's part
are placed there: a column-parallel part is one run of the global tensor, a row-parallel part one run per row.
A part that several ranks hold (a replicated norm) is read from the first of them. The joined index is the
global model's, so a state without tp and a tp state (each rank slicing its part out, :mod:`.mapping`) load it alike.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.deepspeed.shards import Piece, ShardIndex, check_coverage
from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointUnsupportedError


def join_tp(folder: Path, indexes: Sequence[ShardIndex], main: Mapping[str, Any]) -> ShardIndex:
    """The index of the global model whose tp rank j's index is ``indexes[j]`` (``main``: rank 0's model states)."""
    info = main.get("universal_checkpoint_info")
    affine = info.get("affine_map", {}).get("params") if isinstance(info, Mapping) else None
    if not isinstance(affine, Mapping):
        raise CheckpointUnsupportedError(
            f"{folder} holds the files of {len(indexes)} tensor-parallel ranks but its model states record no "
            "affine map of their parts (universal_checkpoint_info, DeepSpeed 0.19 and later): convert it with "
            "DeepSpeed's ds_to_universal.py first")
    first = indexes[0]
    trainable, pieces = {}, dict(first.pieces)
    for name in first.trainable:
        entry = next((v for k, v in affine.items() if re.fullmatch(k, name)), None)
        if entry is None:
            raise CheckpointCorruptError(f"{folder}: the affine map of its tp parts has no entry for {name}")
        trainable[name] = torch.Size(entry["logical_shape"])
        placed = []
        for rank, index in enumerate(indexes):
            for part in entry["ranks"][rank]["pieces"]:
                if part["locations"][0] == rank:  # a replicated part: the first rank that holds it
                    placed += _placed(folder, name, index.pieces[name], part)
        pieces[name] = tuple(sorted(placed, key=lambda p: p.offset))
    joined = dataclasses.replace(first, trainable=trainable, pieces=pieces)
    check_coverage(folder, joined)
    return joined


def _placed(folder: Path, name: str, local: Sequence[Piece], part: Mapping[str, Any]) -> list[Piece]:
    """``local`` (the pieces of one rank's part, offsets in the part) at their offsets in the global tensor."""
    shape, (base, strides), (dest, dest_strides) = part["shape"], part["source"], part["dest"]
    contiguous = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    if dest != 0 or list(dest_strides) != contiguous:
        raise CheckpointUnsupportedError(f"{folder}: {name}'s tp parts are not each one block of the global tensor "
                                         "(several pieces per rank); convert it with ds_to_universal.py first")
    run = math.prod(shape) if list(strides) == contiguous else shape[-1] if strides[-1] == 1 else 1

    def where(i: int) -> int:
        return base + sum((i // contiguous[k]) % shape[k] * strides[k] for k in range(len(shape)))

    out = []
    for piece in local:
        i, end = piece.offset, piece.offset + piece.numel
        while i < end:
            stop = min(end, (i // run + 1) * run)
            out.append(Piece(piece.path, piece.key, piece.start + i - piece.offset, stop - i, where(i)))
            i = stop
    return out
