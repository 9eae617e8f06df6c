"""``deepspeed.utils.zero_to_fp32``: a checkpoint's consolidated fp32 weights, for dsfunc's and DeepSpeed's checkpoints.

DeepSpeed's functions and script, streamed through dsfunc's export (:func:`dsfunc.checkpoint.export.weights`,
one unit or batch of tensors in memory at a time while files are written), offline: no process group, no
DeepSpeed. ``checkpoint_dir`` is a save directory (holding ``latest`` and the tag folders), as DeepSpeed's.

``python -m dsfunc.deepspeed.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
[--max_shard_size 5GB] [--exclude_frozen_parameters]`` is DeepSpeed's script; a save writes a copy of it into
``save_dir`` as ``zero_to_fp32.py`` (DeepSpeed's recovery script), which runs this one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from dsfunc.checkpoint.export import weights, write_safetensors, write_torch
from dsfunc.checkpoint.hf import parse_size, shards, take
from dsfunc.checkpoint.tags import PathLike


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 ``state_dict`` (on the CPU): every name ``model.state_dict()`` has, tied names
    sharing one tensor, frozen parameters left out with ``exclude_frozen_parameters``. ``tag`` defaults to the
    one ``checkpoint_dir/latest`` names. ``lazy_mode`` is accepted: the tensors are real ones, whose
    ``.contiguous()`` is what DeepSpeed's lazy tensors give."""
    _, _, keys, tensors = weights(checkpoint_dir, tag, with_aliases=False, exclude_frozen=exclude_frozen_parameters)
    read = dict(tensors)
    return {name: read[source] for name, source in keys}


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: PathLike,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it (``strict=False``, as
    DeepSpeed) and return it."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: PathLike, output_dir: PathLike,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the checkpoint's fp32 weights into ``output_dir`` as DeepSpeed does: ``pytorch_model.bin``
    (``torch.load``) or, with ``safe_serialization``, ``model.safetensors``; past ``max_shard_size`` (bytes or
    a size such as ``"5GB"``; None: one file) in shards ``pytorch_model-00001-of-0000N.bin`` ... with
    ``pytorch_model.bin.index.json`` (``model.safetensors.index.json``) mapping each name to its file."""
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors stores tied names separately; torch.save shares one tensor among them (as export_fp32)
    layout, _, keys, tensors = weights(checkpoint_dir, tag, with_aliases=safe_serialization,
                                       exclude_frozen=exclude_frozen_parameters)
    parts = [list(layout)] if max_shard_size is None else shards(layout, parse_size(max_shard_size))
    stem, suffix = name.rsplit(".", 1)
    files = [name] if len(parts) == 1 else [f"{stem}-{i + 1:05d}-of-{len(parts):05d}.{suffix}"
                                            for i in range(len(parts))]
    weight_map = {}
    for file, part in zip(files, parts):
        names = {n for n, _, _ in part}
        if safe_serialization:
            write_safetensors(out / file, part, take(tensors, len(part)))
        else:
            write_torch(out / file, part, take(tensors, len(part)), keys=[k for k in keys if k[1] in names])
        weight_map.update({key: file for key, source in keys if source in names})
    if len(parts) > 1:
        total = sum(dtype.itemsize * math.prod(shape) for _, shape, dtype in layout)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / f"{name}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` command line."""
    parser = argparse.ArgumentParser(prog="zero_to_fp32.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="the save directory, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the directory to write the fp32 state_dict file(s) into")
    parser.add_argument("--max_shard_size", default="5GB", help="the largest file before sharding (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors, not torch.save")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; dsfunc prints nothing more")
    args = parser.parse_args(argv)
    _check_order(args.checkpoint_dir, args.output_dir)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization, tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)
    print(f"fp32 weights of {args.checkpoint_dir} written to {args.output_dir}")


def _check_order(checkpoint_dir: str, output_dir: str) -> None:
    """A clear error for swapped arguments (the output exists as a checkpoint, the input does not)."""
    if not os.path.exists(checkpoint_dir) and os.path.isfile(os.path.join(output_dir, "latest")):
        raise SystemExit(f"zero_to_fp32: {checkpoint_dir} does not exist and {output_dir} is a checkpoint "
                         "directory: the checkpoint comes first, then the output directory")


if __name__ == "__main__":
    main()
