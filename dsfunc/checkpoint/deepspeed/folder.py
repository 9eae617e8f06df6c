"""Which files make up a DeepSpeed checkpoint folder, and which DeepSpeed layouts dsfunc can read.

DeepSpeed's engine writes, into ``save_dir/<tag>/`` (``deepspeed/runtime/engine.py``, ``_get_ckpt_name`` and
``_get_zero_ckpt_name``)::

    mp_rank_00_model_states.pt                          module state_dict, counters, lr scheduler, client state,
                                                        and at stage 0 the optimizer (ZeRO stages 0-2)
    zero_pp_rank_<r>_mp_rank_00_model_states.pt         the same, one per data-parallel rank (ZeRO-3)
    [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  rank r's partition of the fp32 master weights and
                                                        optimizer state (ZeRO 1-3, and the bf16 optimizer)

and ``save_dir/latest`` holding the tag. AutoTP (tensor parallelism) writes the same files for each tp rank,
``mp_rank_01`` and higher (joined by :mod:`.autotp`). Pipeline parallelism writes
``layer_<i>-model_<j>-model_states.pt``, mixture-of-experts ``expp_rank_*`` and ``layer_*_expert_*`` files, NVMe offload an ``offloaded_tensors/`` folder: those layouts are refused here,
naming the file, before anything is read.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointUnsupportedError
from dsfunc.checkpoint.files import open_regular

_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_UNSUPPORTED = (
    (re.compile(r"^layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt$"), "mixture-of-experts expert weights"),
    (re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$"), "mixture-of-experts optimizer state"),
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"), "pipeline-parallel layer weights"),
)


@dataclasses.dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint folder (one tag)."""

    folder: Path
    model_states: tuple[Path, ...]  # one file (ZeRO 0-2), or one per data-parallel rank (ZeRO-3)
    optim_states: tuple[Path, ...]  # one per data-parallel rank, in rank order; empty when the optimizer
    #                                 state is inside the model states (stage 0 without the bf16 optimizer)

    @property
    def main(self) -> Path:
        """The model-states file that holds the counters, scheduler and client state (rank 0's)."""
        return self.model_states[0]


def is_deepspeed_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a DeepSpeed checkpoint (any model-states file, readable or not)."""
    try:
        return folder.is_dir() and any(
            _MODEL.match(p.name) or _UNSUPPORTED[2][0].match(p.name) for p in folder.iterdir())
    except OSError:
        return False


def model_parallel_ranks(folder: Path) -> int:
    """How many tensor-parallel (AutoTP) ranks wrote the checkpoint in ``folder``: one set of files each (any
    file names its rank: :func:`find_files` then says which of a rank's files are missing)."""
    ranks = [int(m.groups()[-1]) for p in folder.iterdir() if (m := _MODEL.match(p.name) or _OPTIM.match(p.name))]
    return max(ranks, default=0) + 1


def find_files(folder: Path, mp: int = 0) -> DeepSpeedFiles:
    """The files model-parallel rank ``mp`` wrote of the DeepSpeed checkpoint in ``folder``, checked for
    completeness.

    Raises:
      NotRegularFileError: one of them is a symbolic link, a FIFO or a device, not a regular file.
      CheckpointUnsupportedError: a model-parallel, pipeline-parallel, mixture-of-experts or NVMe-offload
        checkpoint (the message names the file).
      CheckpointCorruptError: a rank's file is missing.
    """
    names = sorted(p.name for p in folder.iterdir())
    for name in names:
        _refuse_unsupported(folder, name)
    per_rank = {int(m.group(1)): folder / n for n in names
                if (m := _MODEL.match(n)) and m.group(1) is not None and int(m.group(2)) == mp}
    optim = {int(m.group(2)): folder / n for n in names if (m := _OPTIM.match(n)) and int(m.group(3)) == mp}
    if per_rank:
        model_states = _complete(folder, per_rank, f"zero_pp_rank_{{}}_mp_rank_{mp:02d}_model_states.pt")
    elif (folder / f"mp_rank_{mp:02d}_model_states.pt").is_file():
        model_states = (folder / f"mp_rank_{mp:02d}_model_states.pt",)
    else:
        raise CheckpointCorruptError(f"{folder} has no mp_rank_{mp:02d}_model_states.pt: not a complete DeepSpeed "
                                     "checkpoint (a save that did not finish?)")
    prefix = "bf16_" if any(_OPTIM.match(p.name).group(1) for p in optim.values()) else ""
    optim_states = (_complete(folder, optim, prefix + f"zero_pp_rank_{{}}_mp_rank_{mp:02d}_optim_states.pt")
                    if optim else ())
    if per_rank and len(optim_states) != len(model_states):
        raise CheckpointCorruptError(
            f"{folder} has {len(model_states)} ZeRO-3 model-states files but {len(optim_states)} optimizer-states "
            "files: one of each per data-parallel rank was written; some are missing")
    for path in (*model_states, *optim_states):
        with open_regular(path):  # a link, FIFO or device is refused before any reader opens it
            pass
    return DeepSpeedFiles(folder, model_states, optim_states)


def _refuse_unsupported(folder: Path, name: str) -> None:
    path = folder / name
    if name == "offloaded_tensors" and path.is_dir():
        raise CheckpointUnsupportedError(
            f"{path}: the optimizer state of this DeepSpeed checkpoint was offloaded to NVMe "
            "(offload_optimizer.device 'nvme'), which dsfunc does not import. Resume it once in DeepSpeed "
            "without NVMe offload and save again, or load only the weights with load_optimizer_states=False "
            "after removing that folder.")
    for pattern, what in _UNSUPPORTED:
        if pattern.match(name):
            raise CheckpointUnsupportedError(
                f"{path}: {what}. dsfunc imports data-parallel DeepSpeed checkpoints (ZeRO stages 0-3) only; "
                "convert this one with DeepSpeed's ds_to_universal.py or zero_to_fp32.py first.")


def _complete(folder: Path, by_rank: dict[int, Path], pattern: str) -> tuple[Path, ...]:
    """The files of ranks 0..N-1 in order, or an error naming the first one missing."""
    world = max(by_rank) + 1
    missing = [pattern.format(r) for r in range(world) if r not in by_rank]
    if missing:
        raise CheckpointCorruptError(
            f"the DeepSpeed checkpoint {folder} is incomplete: {', '.join(missing)} is missing (every "
            "data-parallel rank writes its own file)")
    return tuple(by_rank[r] for r in range(world))
