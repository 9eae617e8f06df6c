"""The engine's training state and the optimizer step it has in progress.

An engine's step is opened by its first training forward and closed at the accumulation boundary of
``engine.step()``; in between, forwards may come from the engine (``engine(x)``) or from its module called
directly (``net(x)``, :mod:`dsfunc.deepspeed.direct`). Both go through this one object, so they open, run,
abandon and finish a step the same way and neither reaches into the other's private state.
"""

from __future__ import annotations

import logging

import torch

from dsfunc.deepspeed.engine_runtime import EngineRuntime
from dsfunc.state import TrainState
from dsfunc.step import apply_gradients, check_min_scale
from dsfunc.zero.runtime import Phase, zero_runtime

logger = logging.getLogger("dsfunc")


def transformed() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, jacrev, vmap) is running: a forward under one is a function
    the transform differentiates or batches, not a micro-batch of the step (its leaves could not be made there),
    so it runs on the current weights as an evaluation does, with autograd left on (as DeepSpeed's engine
    short-circuits its hooks under torch.func)."""
    return torch._C._functorch.maybe_current_level() is not None


class StepInProgress:
    """The current :class:`~dsfunc.TrainState`, the runtime of the optimizer step in progress (``None``
    between steps) and the micro-batches counted so far (DeepSpeed's ``micro_steps``)."""

    def __init__(self, state: TrainState, *, trains: bool) -> None:
        self.state = state  # replaced at every optimizer step; the replaced ones are donated
        self.trains = trains  # whether there is an optimizer: without one every forward is an evaluation
        self.runtime: EngineRuntime | None = None
        self.micro_steps = 0
        # the client's word on whether the current micro-batch ends the optimizer step (DeepSpeed's
        # set_gradient_accumulation_boundary: accelerate runs the step's backwards and calls step() once); without
        # managed_gradient_accumulation every step() ends one, after however many backwards
        self.boundary: bool | None = None if state.program.config.managed_gradient_accumulation else True

    @property
    def accumulation_steps(self) -> int:
        return self.state.program.config.gradient_accumulation_steps

    @property
    def phase(self) -> Phase:
        """Where the current micro-batch is: ``IDLE`` (forward next), ``FORWARD`` (backward next) or
        ``BACKWARD`` (step next, or another forward/backward pair)."""
        return self.runtime.phase if self.runtime is not None else Phase.IDLE

    def trains_now(self) -> bool:
        """Whether a forward now is a training forward: autograd enabled, an optimizer to train, and no
        ``torch.func`` transform running (see :func:`transformed`)."""
        return self.trains and torch.is_grad_enabled() and not transformed()

    def in_forward(self) -> bool:
        """Whether one of the runtime's forwards is running now (a direct call inside it passes through)."""
        return self.state.program.run.workspace.active is not None

    def micro(self) -> tuple[int, int]:
        """``(index, count)`` of the current micro-batch in its optimizer step (the last index exactly when
        it is the boundary, so the reducer finishes the step's reductions there)."""
        count = self.accumulation_steps
        if self.boundary is not None:
            return (count - 1 if self.boundary else 0), count
        return self.micro_steps % count, count

    def place(self) -> None:
        """Tell the open micro-batch its place again after the client declared the boundary: accelerate
        does so between a forward and its backward, so the place the forward took may be stale."""
        if self.boundary is not None and self.runtime is not None:
            self.runtime.place(self.micro())

    def is_boundary(self) -> bool:
        """True while the current micro-batch is the last of its optimizer step: the client's word when it
        gave one, else every ``gradient_accumulation_steps``-th micro-batch."""
        if self.boundary is not None:
            return self.boundary
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def begin(self) -> EngineRuntime:
        """The runtime of the step in progress, opened now if this is the step's first training forward."""
        if self.runtime is None:
            check_min_scale(self.state)
            self.runtime = zero_runtime(self.state, EngineRuntime)
        return self.runtime

    def for_evaluation(self) -> EngineRuntime:
        """A runtime to evaluate on: the open step's (its bindings stay valid), else a fresh one."""
        return self.runtime if self.runtime is not None else zero_runtime(self.state, EngineRuntime)

    def end_micro_batch(self) -> bool:
        """Close the current micro-batch (after its backwards); True if it ended the optimizer step."""
        boundary = self.is_boundary()
        self.runtime.end()
        self.micro_steps += 1
        return boundary

    def finish(self, lr: dict[str | None, float] | None = None) -> TrainState:
        """Apply the step's gradients (or skip them on overflow), with ``lr`` replacing those groups' lr
        (see :func:`~dsfunc.apply_gradients`): the new state replaces the old, donated."""
        loss, grads = self.runtime.finish()
        self.runtime = None
        old = self.state
        self.state = apply_gradients(old, grads, loss, lr=lr or None)
        old.mark_donated()
        return self.state

    def abandon(self) -> None:
        """After a failed forward: drop this optimizer step's micro-batches; the step starts again."""
        if self.runtime is not None:
            self.runtime.drop_forward()
        self.runtime = None
        self.micro_steps -= self.micro_steps % self.accumulation_steps
        logger.warning("the forward failed; the micro-batches of this optimizer step were dropped")

    def drop_forwards_without_backward(self) -> None:
        """Close a step that only ran forwards (an evaluation with autograd on): it has nothing to lose."""
        if self.runtime is not None and not self.runtime.has_gradients:
            self.runtime.drop_forward()
            self.runtime = None
