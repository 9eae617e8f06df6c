"""A batch reaches the user's forward through few of dsfunc's frames: each one is a layer a reader of a traceback
or a profile has to get through, and a place state can hide in."""

from __future__ import annotations

import pathlib
import sys

import pytest

import dsfunc
from tests.models import MLP, config, mlp_batches

PACKAGE = pathlib.Path(dsfunc.__file__).resolve().parent


def _ours(frame) -> bool:
    return pathlib.Path(frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)


def _frames_to(code, run) -> list[str]:
    """The dsfunc frames on the stack when ``code`` is first called inside ``run()``, innermost first."""
    seen: list[list[str]] = []

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code is code and not seen:
            stack, f = [], frame.f_back
            while f is not None:
                if _ours(f):
                    stack.append(f"{pathlib.Path(f.f_code.co_filename).name}:{f.f_code.co_name}")
                f = f.f_back
            seen.append(stack)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    assert seen, "the model's forward never ran"
    return seen[0]


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("own_loss_fn", [False, True])
def test_train_step_reaches_the_model_in_at_most_six_dsfunc_frames(stage, own_loss_fn):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    kwargs = {"loss_fn": lambda model, batch: model(*batch)} if own_loss_fn else {}
    state = dsfunc.init_state(MLP(width=16), config(micro=2, gas=2, stage=stage, zero_optimization=zero), **kwargs)
    batch = mlp_batches(1, 4)[0]
    frames = _frames_to(MLP.forward.__code__, lambda: dsfunc.train_step(state, batch))
    assert frames[-1] == "step.py:train_step", frames
    assert len(frames) <= 6, frames
    assert len(set(frames)) == len(frames), f"two frames of one name read as one in a traceback: {frames}"

