"""Which files make up a DeepSpeed checkpoint folder, and which DeepSpeed layouts dsfunc can read.

DeepSpeed's engine writes, into ``save_dir/<tag>/`` (``deepspeed/runtime/engine.py``, ``_get_ckpt_name`` and
``_get_zero_ckpt_name``)::

    mp_rank_00_model_states.pt                          module state_dict, counters, lr scheduler, client state,
                                                        and at stage 0 the optimizer (ZeRO stages 0-2)
    zero_pp_rank_<r>_mp_rank_00_model_states.pt         the same, one per data-parallel rank (ZeRO-3)
    [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  rank r's partition of the fp32 master weights and
                                                        optimizer state (ZeRO 1-3, and the bf16 optimizer)

and ``save_dir/latest`` holding the tag. AutoTP (tensor parallelism) writes the same files for each tp rank,
``mp_rank_01`` and higher (joined by :mod:`.autotp`). A model with DeepSpeed's ``MoE`` layers adds one file per
expert, ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt``, and at stage 0 one optimizer file per expert-parallel
rank, ``expp_rank_<q>_mp_rank_00_optim_states.pt`` (joined by :mod:`.experts`). Pipeline parallelism writes
``layer_<i>-model_<j>-model_states.pt``, DeepSpeed before 0.6 its experts as ``expert_<e>_mp_rank_*`` files,
NVMe offload an ``offloaded_tensors/`` folder: those layouts are refused here, naming the file, before anything is
read.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointUnsupportedError
from dsfunc.checkpoint.files import open_regular

_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_EXPERT = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPERT_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
_UNSUPPORTED = (
    (_PIPELINE, "pipeline-parallel layer weights"),
    (re.compile(r"^expert_\d+_mp_rank_\d+_model_states\.pt$"), "experts in the layout of DeepSpeed before 0.6"),
)


@dataclasses.dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint folder (one tag)."""

    folder: Path
    model_states: tuple[Path, ...]  # one file (ZeRO 0-2), or one per data-parallel rank (ZeRO-3)
    optim_states: tuple[Path, ...]  # one per data-parallel rank, in rank order; empty when the optimizer
    #                                 state is inside the model states (stage 0 without the bf16 optimizer)
    experts: tuple[tuple[Path, ...], ...] = ()  # per MoE layer (in module order), one file per expert
    expert_optim_states: tuple[Path, ...] = ()  # stage 0 with experts: one per expert-parallel rank

    @property
    def main(self) -> Path:
        """The model-states file that holds the counters, scheduler and client state (rank 0's)."""
        return self.model_states[0]


def is_deepspeed_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a DeepSpeed checkpoint (any model-states file, readable or not)."""
    try:
        return folder.is_dir() and any(
            _MODEL.match(p.name) or _PIPELINE.match(p.name) for p in folder.iterdir())
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
      CheckpointUnsupportedError: a pipeline-parallel, NVMe-offload or pre-0.6 mixture-of-experts checkpoint (the
        message names the file).
      CheckpointCorruptError: a rank's or an expert's file is missing.
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
    experts, expert_optim = _expert_files(folder, names, mp)
    for path in (*model_states, *optim_states, *(p for layer in experts for p in layer), *expert_optim):
        with open_regular(path):  # a link, FIFO or device is refused before any reader opens it
            pass
    return DeepSpeedFiles(folder, model_states, optim_states, experts, expert_optim)


def _expert_files(folder: Path, names: list[str], mp: int) -> tuple[tuple[tuple[Path, ...], ...], tuple[Path, ...]]:
    """The expert files of model-parallel rank ``mp``: per layer, per expert; and the expert-parallel optimizers."""
    layers: dict[int, dict[int, Path]] = {}
    for name in names:
        if (m := _EXPERT.match(name)) and int(m.group(3)) == mp:
            layers.setdefault(int(m.group(1)), {})[int(m.group(2))] = folder / name
    optim = {int(m.group(1)): folder / n for n in names if (m := _EXPERT_OPTIM.match(n)) and int(m.group(2)) == mp}
    if layers and sorted(layers) != list(range(len(layers))):
        missing = min(set(range(max(layers) + 1)) - set(layers))
        raise CheckpointCorruptError(f"the DeepSpeed checkpoint {folder} has no file of MoE layer {missing}'s experts "
                                     f"(layer_{missing}_expert_*_mp_rank_{mp:02d}_model_states.pt): it is incomplete")
    experts = tuple(_complete(folder, layers[i], f"layer_{i}_expert_{{}}_mp_rank_{mp:02d}_model_states.pt",
                              "every expert") for i in range(len(layers)))
    expert_optim = (_complete(folder, optim, f"expp_rank_{{}}_mp_rank_{mp:02d}_optim_states.pt",
                              "every expert-parallel rank") if optim else ())
    if expert_optim and not experts:
        raise CheckpointCorruptError(f"the DeepSpeed checkpoint {folder} has the optimizer files of expert-parallel "
                                     "ranks (expp_rank_*) but no expert's weights (layer_*_expert_*): it is incomplete")
    return experts, expert_optim


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
                f"{path}: {what}. dsfunc imports data-parallel, AutoTP and MoE DeepSpeed checkpoints (ZeRO stages "
                "0-3) only; convert this one with DeepSpeed's ds_to_universal.py or zero_to_fp32.py first.")


def _complete(folder: Path, by_rank: dict[int, Path], pattern: str,
              writer: str = "every data-parallel rank") -> tuple[Path, ...]:
    """The files of ranks (or experts) 0..N-1 in order, or an error naming those missing."""
    world = max(by_rank) + 1
    missing = [pattern.format(r) for r in range(world) if r not in by_rank]
    if missing:
        raise CheckpointCorruptError(
            f"the DeepSpeed checkpoint {folder} is incomplete: {', '.join(missing)} is missing ({writer} writes "
            "its own file)")
    return tuple(by_rank[r] for r in range(world))
