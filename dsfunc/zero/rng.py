"""The random streams of a micro-batch's forward: dropout that a resumed run draws again exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dsfunc.state import TrainState


@contextlib.contextmanager
def micro_batch_rng(state: TrainState, micro: int, forward: int) -> Iterator[None]:
    """Seed dropout from (seed, step, micro-batch, rank, and the forward's index in the micro-batch after the
    first) so a resumed run draws the same masks and two forwards draw different ones."""
    device = state.program.device
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():  # a graphed step seeds per step (dsfunc.graphs)
        yield
        return
    key = (int(state.rng[0]), int(state.step), micro, state.program.plan.rank)
    seed = hash(key if forward == 0 else (*key, forward)) & 0x7FFF_FFFF_FFFF
    with torch.random.fork_rng(devices=[device] if cuda else []):
        # Seed the generators this step draws from, not torch.manual_seed: that one also seeds every other
        # accelerator type lazily, recording a Python stack each time (half the step on a small model), and
        # would change the other GPUs' streams.
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[device.index if device.index is not None else 0].manual_seed(seed)
        yield
