"""Loading a DeepSpeed checkpoint into a template state: the DeepSpeed branch of :func:`dsfunc.load_checkpoint`.

Every rank opens the checkpoint and checks it against its template (:mod:`.contents`, :mod:`.mapping`)
before any tensor is read, and reads only its own slice of each unit, whatever the world size and ZeRO
stage DeepSpeed saved at; both steps are collective in outcome (:func:`~dsfunc.checkpoint.coordination.collective`):
if one rank fails, every rank raises the same error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dsfunc.checkpoint.compat import Selection
from dsfunc.checkpoint.coordination import collective
from dsfunc.checkpoint.deepspeed.contents import open_checkpoint
from dsfunc.checkpoint.deepspeed.folder import is_deepspeed_folder
from dsfunc.checkpoint.deepspeed.mapping import fill, plan_import
from dsfunc.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from dsfunc.checkpoint.tags import PathLike, find_checkpoint
from dsfunc.state import TrainState


def deepspeed_folder(load_dir: PathLike, tag: str | None = None) -> Path | None:
    """The DeepSpeed checkpoint folder ``load_dir`` and ``tag`` name, or None when they name none (a dsfunc
    checkpoint, or nothing: the dsfunc path then reports what is missing)."""
    try:
        folder = find_checkpoint(load_dir, tag)
    except CheckpointNotFoundError:
        return None
    return folder if is_deepspeed_folder(folder) else None


def load_deepspeed(folder: Path, state: TrainState, selection: Selection, *,
                   trust_pickle: bool = False) -> tuple[TrainState, dict[str, Any]]:
    """Load the DeepSpeed checkpoint in ``folder`` into the template ``state`` (donated, as in
    :func:`dsfunc.load_checkpoint`); return ``(new_state, client_state)``."""
    def open_and_check():
        ckpt = open_checkpoint(folder, trust_pickle=trust_pickle, frozen_hint=state.program.plan.frozen)
        return ckpt, plan_import(ckpt, state, selection)

    ckpt, plan = collective(open_and_check)  # nothing of the template is touched before this succeeds
    try:
        collective(lambda: fill(ckpt, state, plan))
    except CheckpointError as e:
        state.mark_donated()
        raise CheckpointError(
            f"importing the DeepSpeed checkpoint {folder} failed: {e}. The template state was partly "
            "overwritten and is consumed; build a fresh one with dsfunc.init_state before trying again."
        ) from e
    new = dataclasses.replace(state)  # as dsfunc.checkpoint.api.load_checkpoint hands the filled template on
    state.mark_donated()
    new.program.run.workspace.refresh(new.params)
    return new, ckpt.client
