"""Runs for the tensor-parallel checkpoint tests: a tiny Hugging Face Llama trained at tp 2 x dp 2, saved after
4 steps, and resumed from that checkpoint at another mesh (tp 1 x dp 4, sp 2, one process) for 4 more."""

from __future__ import annotations

from typing import Any

import torch

import dsfunc
from tests.parallel import tp_runs as runs

SAVED, MORE = 4, 4


def llama() -> torch.nn.Module:
    """The tp tests' Llama, attending through sdpa, which Ulysses (sp) can route as well."""
    model = runs.llama()
    model.config._attn_implementation = "sdpa"
    return model


def _steps(state: dsfunc.TrainState, steps: range) -> tuple[dsfunc.TrainState, list[float]]:
    """Train ``state`` on each step's global batch, this rank's data-parallel slice of it (an sp rank takes its
    replica's whole sequences: the state splits them)."""
    mesh = state.program.mesh
    dp, rank = (1, 0) if mesh is None else (mesh.size("dp"), mesh.group("dp").rank)
    losses = []
    for step in steps:
        state = dsfunc.train_step(state, {k: v.chunk(dp)[rank] for k, v in runs.batch(step).items()})
        losses.append(float(state.metrics.loss))
    return state, losses


def save_at_tp2(rank: int, world: int, config: dict[str, Any], folder: str) -> dict[str, Any]:
    """At tp 2 x dp 2: 4 steps, save, 4 more (the uninterrupted run); then a fresh state loads the checkpoint
    and trains the same 4 steps (the resume at the saving mesh)."""
    state, _ = _steps(dsfunc.init_state(llama(), config), range(SAVED))
    dsfunc.save_checkpoint(state, folder)
    saved = dsfunc.full_params(state)
    state, losses = _steps(state, range(SAVED, SAVED + MORE))
    resumed, _ = dsfunc.load_checkpoint(folder, dsfunc.init_state(llama(), config))
    resumed, resumed_losses = _steps(resumed, range(SAVED, SAVED + MORE))
    return {"saved": saved, "losses": losses, "params": dsfunc.full_params(state),
            "resumed_losses": resumed_losses, "resumed_params": dsfunc.full_params(resumed)}


def resume(rank: int, world: int, config: dict[str, Any], folder: str) -> dict[str, Any]:
    """Load the checkpoint into a fresh state of ``config``'s mesh: its parameters as loaded, then 4 steps."""
    state, _ = dsfunc.load_checkpoint(folder, dsfunc.init_state(llama(), config))
    loaded = dsfunc.full_params(state)
    state, losses = _steps(state, range(SAVED, SAVED + MORE))
    return {"loaded": loaded, "losses": losses, "params": dsfunc.full_params(state)}


def max_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest norm-wise relative difference over the parameters."""
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)


def flat_into_tp(rank: int, world: int, folder: str) -> str:
    """What loading a checkpoint saved without tp (one flat vector per unit) into a tp 2 template says."""
    dsfunc.save_checkpoint(dsfunc.init_state(llama(), runs.ds_config(runs.SGD, 1, 2)), folder)
    template = dsfunc.init_state(llama(), runs.ds_config(runs.SGD, 1, 1, tp=2))
    try:
        dsfunc.load_checkpoint(folder, template)
    except dsfunc.CheckpointMismatchError as e:
        assert not template.donated  # refused before anything was read into it
        return str(e)
    raise AssertionError("the load was not refused")
