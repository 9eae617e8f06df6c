"""The training step: gradients from a gradient function, then the update half.

:func:`make_train_step` joins a gradient function (:mod:`dsfunc.grad`) and an update into
``step(state, batch, donate=True) -> state``; :func:`train_step` runs the one the state was built with.
:func:`apply_gradients` is the update half on its own (the DeepSpeed engine calls it at the
accumulation boundary): the global norm and overflow check, the optimizer update, the loss scaler and
the metrics, without a host sync.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from dsfunc import kernels
from dsfunc.batch import Batch
from dsfunc.errors import InputError, InputTypeError
from dsfunc.grad import GradContext, GradFn, default_grad_fn
from dsfunc.optim.base import Transform
from dsfunc.optim.transforms import current_lr
from dsfunc.optim.update import ChainUpdate
from dsfunc.scaling import MinScaleCheck
from dsfunc.state import Metrics, TrainState
from dsfunc.zero.norms import global_norm_and_loss

# The host's copy of each state's scaler.dead flag, made without stalling the device; checked when the
# state is stepped again (weak: a state that is dropped takes its check with it).
_MIN_SCALE_CHECKS: weakref.WeakKeyDictionary[TrainState, MinScaleCheck] = weakref.WeakKeyDictionary()


def make_train_step(grad_fn: GradFn | None = None, optimizer: Transform | None = None) -> Callable[..., TrainState]:
    """Join a gradient function and an update transform into ``step(state, batch, donate=True)``.

    Args:
      grad_fn: a composed gradient function (default :func:`dsfunc.default_grad_fn`). It must return
        gradients laid out like ``state.params`` (wrap it in :func:`dsfunc.shard` for that).
      optimizer: an update transform over ``state.params`` (default: the state's own, from the config:
        unscale, clip by global norm, then the configured optimizer and schedule). ``state.opt_state``
        must come from its ``init``: pass the same transform to ``init_state(optimizer=...)``.

    Returns:
      A function like :func:`train_step`; call it in place of ``dsfunc.train_step``.
    """
    # a partial, not a closure: one frame less between train_step and the model
    return functools.partial(_run_step, grad_fn=grad_fn or default_grad_fn(), optimizer=optimizer)


def train_step(state: TrainState, batch: Batch, *, donate: bool = True) -> TrainState:
    """One optimizer step: ``state`` in, new state out.

    ``batch`` is this rank's data for the whole step: ``micro_batch * gradient_accumulation_steps``
    samples along dim 0 (any pytree of tensors), or a list of ``gradient_accumulation_steps``
    micro-batches. With ``donate=True`` (the default) the returned state reuses ``state``'s buffers and
    ``state`` may not be used again; ``donate=False`` keeps it intact at the cost of a copy.
    """
    if not isinstance(state, TrainState):
        raise InputTypeError(f"train_step expects a TrainState from dsfunc.init_state, got {type(state).__name__}")
    state.check_usable()
    return state.program.step_fn(state, batch, donate)


def check_min_scale(state: TrainState) -> None:
    """Raise :class:`~dsfunc.LossScaleError` if the step that made ``state`` overflowed at the minimum
    loss scale (once the device has got there; never waits for it)."""
    check = _MIN_SCALE_CHECKS.get(state)
    if check is not None and not (check.event is not None and torch.cuda.is_current_stream_capturing()):
        # (while dsfunc.graphs captures a step, the event query would break the capture: it checks first)
        check.raise_if_dead(state.program.scaler, state.scaler)


def _run_step(state: TrainState, batch: Batch, donate: bool = True, *, grad_fn: GradFn, optimizer: Any) -> TrainState:
    state.check_usable()
    check_min_scale(state)
    if not donate:
        state.program.run.wait()  # the copy reads every master: the last step's update is done first
    work = state if donate else optree.tree_map(lambda t: t.clone(), state)
    work.program.run.runner.expect(work, _update_of(work.program, optimizer))  # it may start as gradients land
    # the last step's host update may still run: this forward waits for each unit as it gathers it
    result = grad_fn(GradContext(work), batch)
    new = apply_gradients(work, result.grads, result.loss, optimizer=optimizer)
    if donate:
        state.mark_donated()
    return new


def apply_gradients(
    state: TrainState,
    grads: Mapping[str, torch.Tensor | None] | None,
    loss: torch.Tensor,
    *,
    optimizer: Transform | None = None,
    lr: Mapping[str | None, float] | None = None,
) -> TrainState:
    """The update half of a step: norm, overflow check, optimizer, loss scaler, metrics.

    ``lr`` (parameter group label -> lr; None labels the only group) replaces those groups' constant or
    scheduled lr for this step; their schedules still advance.

    ``grads`` are this rank's reduced gradients laid out like ``state.params`` (still multiplied by the
    loss scale; fp32, or 16-bit where that holds them exactly: :func:`dsfunc.zero.reduce.grad_dtype`);
    ``loss`` is this rank's mean loss. Updates ``state``'s buffers in place (the caller donates it) and
    returns the new state. On a non-finite gradient nothing changes but the
    scaler and the metrics (``skipped = 1``), on every rank alike.
    """
    program = state.program
    run = program.run
    run.wait()  # the last step's update, if it still runs in the background, is done before this one starts
    params = state.params
    grads = {name: g if g is not None else torch.zeros_like(params[name]) for name, g in (grads or {}).items()}
    if grads.keys() != params.keys():
        raise InputError(
            "the gradient function returned gradients for units "
            f"{sorted(grads)} but the state holds {sorted(params)}; wrap it in dsfunc.shard()"
        )
    grads, sumsq = run.runner.collect(grads)  # where the update reads them (and their sum of squares, if taken)
    if run.pipeline is not None:  # the whole model's norm and loss, over every stage
        sumsq, loss = run.pipeline.norm_and_loss(program.plan, grads, loss)
    else:
        sumsq, loss = global_norm_and_loss(program.plan, grads, loss, sumsq=sumsq)
    scale = state.scaler.scale
    update = _update_of(program, optimizer)
    finite, overflow, grad_norm, grad_scale, skipped = kernels.step_scalars(
        sumsq, scale, update.clip_norm, program.scaler.unscaled)
    lowp = run.workspace.lowp_targets() if update.writes_compute_copy else {}
    scalars = _StepScalars(scale, grad_norm, grad_scale, finite, overflow)
    ctx = run.runner.context(scalars, lowp, grads, program.segment_norm, lr)
    params, opt_state = update.apply(params, grads, state.opt_state, ctx)
    run.workspace.refresh(params, written=run.runner.written(lowp))
    run.runner.launch()  # what the update left for the background runs beside the next forward
    scaler = program.scaler.update(state.scaler, overflow)
    lr = current_lr(opt_state)
    metrics = Metrics(
        loss=loss.detach(), grad_norm=grad_norm.detach(), loss_scale=scale.detach().clone(),
        lr=torch.zeros((), device=program.device) if lr is None else lr.detach().to(program.device).clone(),
        skipped=skipped,
    )
    new = dataclasses.replace(
        state, step=state.step + 1, params=params, opt_state=opt_state, scaler=scaler, metrics=metrics,
    )
    if not (new.scaler.dead.is_cuda and torch.cuda.is_current_stream_capturing()):  # dsfunc.graphs: after replay
        note_min_scale(new)
    return new


def _update_of(program: Any, optimizer: Transform | None) -> Any:
    """The update a step applies: ``optimizer``'s chain if given, else the program's own."""
    return ChainUpdate(optimizer) if optimizer is not None else program.update


class _StepScalars(NamedTuple):
    """The step's 0-d tensors that the update reads (:class:`~dsfunc.optim.update.UpdateContext`)."""

    loss_scale: torch.Tensor
    grad_norm: torch.Tensor
    grad_scale: torch.Tensor
    finite: torch.Tensor
    skip: torch.Tensor


def note_min_scale(state: TrainState) -> None:
    """Start the host's copy of ``state.scaler.dead``, which :func:`check_min_scale` reads later."""
    scaler = state.program.scaler
    if scaler.dynamic and scaler.raise_error_at_min_scale:
        _MIN_SCALE_CHECKS[state] = MinScaleCheck(state.scaler.dead)
