"""Saving and loading a :class:`~dsfunc.TrainState`: the public calls, orchestrating the other modules.

A save meets the other ranks (:mod:`.coordination`), describes the state (:mod:`.metadata`) and takes
its tensors under world-size-independent keys (:mod:`.keys`), then writes and publishes them atomically
(:mod:`.publish`), now or in a background thread. A load finds the checkpoint (:mod:`.tags`), checks it
against the template (:mod:`.compat`, :mod:`.metadata`), verifies its files with every rank agreeing, and
only then reads the client state (:mod:`.trust`) and the tensors into the template.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.compat import Selection, check_compatible, wanted
from dsfunc.checkpoint.coordination import arrive, collective
from dsfunc.checkpoint.dcp_io import failure_text, read_tensors
from dsfunc.checkpoint.deepspeed.load import deepspeed_folder, load_deepspeed
from dsfunc.checkpoint.errors import CheckpointError
from dsfunc.checkpoint.keys import load_dict, save_dict
from dsfunc.checkpoint.metadata import describe, read_listed_index, read_meta, verify_files
from dsfunc.checkpoint.per_param import LAYOUT
from dsfunc.checkpoint.publish import write_checkpoint
from dsfunc.checkpoint.tags import PathLike, check_tag, find_checkpoint
from dsfunc.checkpoint.trust import pickle_client_state, read_client_state
from dsfunc.distributed import comm
from dsfunc.distributed.process_group import check_one_world
from dsfunc.errors import InputError, InputTypeError
from dsfunc.state import TrainState

DEFAULT_TIMEOUT = 300.0  # seconds every rank gets to arrive at a save or load

# [Note: one save in flight]
# An async save runs write_checkpoint, with its collectives on the side group, in the one worker thread.
# Every save and load waits for it (wait_for_checkpoint) before its own first collective, so the
# collectives of two checkpoint calls never interleave on that group.
_IN_FLIGHT: Future | None = None
_EXECUTOR: ThreadPoolExecutor | None = None


def save_checkpoint(state: TrainState, save_dir: PathLike, tag: str | None = None, client_state: Any = None,
                    save_latest: bool = True, *, exclude_frozen_parameters: bool = False, async_save: bool = False,
                    timeout: float = DEFAULT_TIMEOUT) -> str:
    """Save ``state`` to ``save_dir/<tag>/``; every rank must call it.

    Args:
      state: the training state (not consumed).
      save_dir: the checkpoint directory (created if needed; shared by all ranks).
      tag: the checkpoint's folder name (default ``global_step<N>``, N = ``int(state.step)``). Saving
        over an existing tag replaces it only once the new checkpoint is complete.
      client_state: anything ``torch.save`` can pickle (rank 0's is kept, as it is at this call),
        returned by the load.
      save_latest: also point ``save_dir/latest`` at this tag.
      exclude_frozen_parameters: leave out the parameters that do not train (a LoRA checkpoint without its
        base model); such a checkpoint loads with ``load_module_strict=False`` into a state that holds them.
      async_save: copy the state to host memory, return, and write in a background thread while
        training continues. One save is in flight at most: the next save or load (or
        :func:`wait_for_checkpoint`) waits for it and raises if it failed.
      timeout: seconds to wait for every rank to arrive, and for another job saving into ``save_dir`` to
        finish publishing, before raising :class:`CheckpointTimeoutError`.

    Returns:
      The checkpoint folder ``save_dir/<tag>`` (for an async save: where it will be once written).
    """
    _check_state(state, "save_checkpoint")
    state.program.run.wait()  # an update still in flight in the background finishes before its values are read
    if not save_dir:
        raise InputError("save_dir is empty: pass the directory to write checkpoints into")
    tag = check_tag(str(tag) if tag is not None else f"global_step{int(state.step)}")
    pipeline = state.program.run.pipeline  # ranks of several runs would overwrite each other's files in save_dir
    tensor = state.program.tensor
    check_one_world(state.program.plan.world_size * (1 if pipeline is None else pipeline.topology.stages)
                    * (1 if tensor is None else tensor.group.size), "save_checkpoint's state")
    wait_for_checkpoint()  # [Note: one save in flight]
    # [Note: meeting before the first collective]; rank 0's tag, as the config's checkpoint.tag_validation allows
    tag = arrive("save_checkpoint", tag, timeout, state.program.config.checkpoint.tag_validation)
    meta = describe(state, tag, exclude_frozen=exclude_frozen_parameters)
    client = collective(lambda: pickle_client_state(client_state) if comm.rank() == 0 else None)
    tensors = save_dict(state, staged=async_save, exclude_frozen=exclude_frozen_parameters)
    job = functools.partial(write_checkpoint, Path(save_dir), tag, tensors, meta, client, save_latest, timeout)
    if not async_save:
        return job()
    global _IN_FLIGHT
    _IN_FLIGHT = _executor().submit(job)
    return str(Path(save_dir) / tag)


def load_checkpoint(load_dir: PathLike, state: TrainState, tag: str | None = None, *,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool | None = None,
                    load_module_only: bool = False, load_module_strict: bool = True, verify: bool = True,
                    trust_pickle: bool = False, timeout: float = DEFAULT_TIMEOUT) -> tuple[TrainState, Any]:
    """Load a checkpoint into the template ``state``; every rank must call it.

    The template is a fresh :func:`dsfunc.init_state` of the same model at any world size, ZeRO stage
    or precision (and, for MoE experts, any expert-parallel degree); it is donated (its tensors are filled in
    place and belong to the returned state).

    A DeepSpeed checkpoint (the ``save_dir`` of DeepSpeed's ``engine.save_checkpoint``, ZeRO stages 0-3, at
    any world size) loads the same way: its fp32 master weights, Adam moments and step count, lr scheduler
    position, fp16 loss scaler and client state (:mod:`dsfunc.checkpoint.deepspeed`).

    Args:
      load_dir: the ``save_dir`` of :func:`save_checkpoint` or of DeepSpeed (or a checkpoint folder itself,
        such as :func:`find_checkpoint` returns).
      state: the template state.
      tag: which checkpoint (default: the one ``load_dir/latest`` names).
      load_optimizer_states: ``False`` keeps the template's fresh optimizer state and loss scaler (as
        DeepSpeed does): for a run with another optimizer.
      load_lr_scheduler_states: whether the lr schedule's position is loaded (default: as
        ``load_optimizer_states``; DeepSpeed's engine passes ``True``).
      load_module_only: load the parameters and buffers only; the step count, dropout seed, metrics,
        optimizer state and schedule stay the template's.
      load_module_strict: ``False`` takes a checkpoint that leaves out frozen parameters (saved with
        ``exclude_frozen_parameters=True``): they keep the template's values. A missing trainable parameter or
        an entry this model lacks is refused either way.
      verify: check every file against the sha256 recorded at save (spread over the ranks, whose
        verdicts are combined before anything is unpickled); sizes are always checked. DeepSpeed records
        no checksums: its files are only checked to fit together.
      trust_pickle: read the checkpoint's pickles (the client state, DCP's ``.metadata``, DeepSpeed's
        files) with full unpickling, for objects beyond tensors, dicts, lists, numbers, strings and the
        formats' own classes. Unpickling can run code: only for a checkpoint whose origin you trust.
      timeout: seconds to wait for every rank to arrive before raising :class:`CheckpointTimeoutError`.

    Returns:
      ``(new_state, client_state)``.

    Trust. The sha256 manifest detects damage, not tampering (whoever can write the files can rewrite it), so
    every pickle of a checkpoint (DCP's .metadata and tensor records, the client state, DeepSpeed's .pt files)
    is read through an allow-list of plain data, tensors and the checkpoint formats' own classes, in
    load_checkpoint and dsfunc export alike: no code from a checkpoint runs unless you pass trust_pickle=True
    (dsfunc export --trust-pickle), which only a checkpoint you would run as code deserves.
    """
    _check_state(state, "load_checkpoint")
    state.program.run.wait()  # an update still in flight in the background finishes before the load overwrites
    wait_for_checkpoint()  # [Note: one save in flight]
    # [Note: meeting before the first collective]
    arrive("load_checkpoint", None if tag is None else str(tag), timeout)
    selection = Selection(
        optimizer=load_optimizer_states, module_only=load_module_only, module_strict=load_module_strict,
        schedule=load_optimizer_states if load_lr_scheduler_states is None else load_lr_scheduler_states,
    )
    if (deepspeed := deepspeed_folder(load_dir, tag)) is not None:
        return load_deepspeed(deepspeed, state, selection, trust_pickle=trust_pickle)
    # [Note: verify, agree, then unpickle] (dsfunc.checkpoint.trust): the verdicts of all ranks first
    folder, meta = collective(lambda: _open(Path(load_dir), tag, state, selection, verify))
    client = collective(lambda: read_client_state(folder, trust_pickle))
    index = collective(lambda: read_listed_index(folder, meta, trust_pickle=trust_pickle))
    targets, copy_back = load_dict(state, wanted(meta, state, selection), per_param=meta.get("layout") == LAYOUT)
    try:
        read_tensors(targets, folder, index)
        with torch.no_grad():
            for device_view, host in copy_back:
                device_view.copy_(host)
    except Exception as e:
        state.mark_donated()
        cause = str(e) if isinstance(e, CheckpointError) else f"copying the tensors failed: {failure_text(e)}"
        raise CheckpointError(
            f"{cause}. The template state was partly overwritten and is consumed; build a fresh one with "
            "dsfunc.init_state before trying again."
        ) from e
    new = dataclasses.replace(state)
    state.mark_donated()
    new.program.run.workspace.refresh(new.params)
    return new, client


def wait_for_checkpoint() -> str | None:
    """Wait for the asynchronous save in flight, if any; return its folder, or raise why it failed.

    Every rank should call it before ``destroy_process_group`` (the save's ranks talk to each other).
    """
    global _IN_FLIGHT
    save, _IN_FLIGHT = _IN_FLIGHT, None
    return None if save is None else save.result()


def _check_state(state: Any, caller: str) -> None:
    if not isinstance(state, TrainState):
        raise InputTypeError(f"{caller} expects a TrainState from dsfunc.init_state, got {type(state).__name__}")
    state.check_usable()


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsfunc-checkpoint")
    return _EXECUTOR


def _open(load_dir: Path, tag: Any, state: TrainState, selection: Selection,
          verify: bool) -> tuple[Path, dict[str, Any]]:
    """Find, read, check and verify the checkpoint before the template is touched: whatever is wrong with
    the checkpoint leaves the template usable. Nothing is unpickled here."""
    folder = find_checkpoint(load_dir, tag)
    meta = read_meta(folder)
    check_compatible(folder, meta, state, selection)
    verify_files(folder, meta, share=(comm.rank(), comm.world_size()) if verify else None)
    return folder, meta
