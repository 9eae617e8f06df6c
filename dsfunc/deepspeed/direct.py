"""A forward through the engine's module itself — ``net(x)`` instead of ``engine(x)`` — as DeepSpeed allows.

DeepSpeed trains the module in place, so scripts call it directly: a GAN feeds the generator's output
to the discriminator's module, an evaluation loop calls the original ``net``. Two hooks on the module
translate such a call onto the engine's runtime, exactly as ``engine(x)`` would run it: with autograd
enabled (and an optimizer) it is a training forward of the current micro-batch (the backward that
follows reaches the engine's gradients), otherwise an evaluation, bound only for this call. Inputs are
moved to the engine's device. A call the engine itself makes (its runtime is bound then) passes through.
Dropout in a direct training forward uses the global generator, not the engine's seeded one.

Between a training forward and its backward the module's parameter tables hold that micro-batch's
views (autograd needs them until the backward, e.g. for activation checkpointing's recompute), so the
module's ``zero_grad()`` — which scripts call between the two (DeepSpeed's GAN example does) — skips them.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import optree
import torch
from torch import nn

from dsfunc.deepspeed.engine_runtime import EngineRuntime
from dsfunc.deepspeed.step_in_progress import StepInProgress, transformed


def install(module: nn.Module, steps: StepInProgress) -> list[Any]:
    """Hook ``module`` so that calling it directly runs through the engine's step in progress, ``steps``;
    returns the hooks' handles."""
    me = weakref.ref(steps)  # the module outlives a dropped engine; its hooks then do nothing
    opened: list[Any] = []  # per call in flight: what the pre-hook opened (None: nothing)

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> Any:
        steps = me()
        if steps is None or steps.in_forward() or (transformed() and steps.state.program.plan.stage < 3):
            # under a torch.func transform at ZeRO 0-2 the module's parameters already hold the current weights,
            # or the tensors torch.func.functional_call put in their place: nothing to bind
            opened.append(None)
            return None
        opened.append(_begin(steps))
        device = steps.state.program.device
        move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
        return optree.tree_map(move, args), optree.tree_map(move, kwargs)

    def post(mod: nn.Module, args: Any, output: Any) -> None:
        token = opened.pop()
        if token is not None:
            _end(token, output)

    handles = [module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
               module.register_forward_hook(post, always_call=True)]
    module._dsfunc_hooks.extend(handles)
    module.zero_grad = types.MethodType(_zero_grad, module)
    return handles


def _zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    """``nn.Module.zero_grad`` over the module's own parameters, skipping a micro-batch's bound views (they
    are not leaves and never hold gradients)."""
    for p in module.parameters():
        if p.is_leaf and p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()


def _begin(steps: StepInProgress) -> tuple[str, StepInProgress, EngineRuntime, bool]:
    """Open the binding of a direct call: a training forward of the current micro-batch, or an evaluation."""
    if steps.trains_now():
        runtime = steps.begin()
        runtime.begin_forward(steps.micro())
        return "train", steps, runtime, True
    runtime = steps.for_evaluation()
    return "eval", steps, runtime, runtime.begin_evaluation()


def _end(token: tuple[str, StepInProgress, EngineRuntime, bool], output: Any) -> None:
    kind, steps, runtime, opened = token
    if kind == "train":
        if output is None:  # the forward raised
            steps.abandon()
    elif opened:
        runtime.end_evaluation()
