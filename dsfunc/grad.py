"""Gradient transforms: composable pieces that turn a loss function into a step's gradients.

A **gradient function** maps ``(GradContext, batch) -> GradResult``. Gradient transforms wrap one:

* :func:`value_and_grad` — forward through the model bound to the state's parameters, then backward;
* :func:`accumulate` — split the step's batch into micro-batches; gradients are their mean;
* :func:`scale_loss` — multiply the loss by the loss scale before backward (fp16);
* :func:`shard` — ZeRO: reduce gradients over the ranks into this rank's shard (their mean).

The default composition is ``scale_loss(shard(accumulate(value_and_grad(loss_fn))))``. Each runs its
micro-batches through one :class:`~dsfunc.zero.runtime.MicroBatchRuntime`, carried in the context:
``shard`` creates it, and ``accumulate`` or ``value_and_grad`` create a local one when nothing outside
them did; whoever created it returns its reduced gradients, the others return ``grads=None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dsfunc.batch import Batch, LossFn, loss_in, model_inputs, scalar_loss, split_batch
from dsfunc.distributed.mesh import Mesh
from dsfunc.errors import UsageError
from dsfunc.state import TrainState
from dsfunc.zero.runtime import MicroBatchRuntime, local_runtime, zero_runtime


@dataclasses.dataclass(frozen=True)
class GradContext:
    """What a gradient function needs besides the batch.

    ``cotangent`` multiplies the loss before backward (the loss scale, set by :func:`scale_loss`); the
    runtime adds the means over ranks and micro-batches. ``runtime`` runs the micro-batches (set by an
    outer :func:`shard` or :func:`accumulate`, which then owns the gradients); ``micro`` is
    ``(index, count)`` inside :func:`accumulate`.
    """

    state: TrainState
    cotangent: torch.Tensor | float = 1.0
    runtime: MicroBatchRuntime | None = None
    micro: tuple[int, int] = (0, 1)

    def replace(self, **changes: Any) -> GradContext:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class GradResult:
    """Mean loss (detached), gradients by unit (``None`` where an outer transform owns them), each in the
    narrowest dtype that holds it exactly (:func:`dsfunc.zero.reduce.grad_dtype`: the backward's bf16 for one
    micro-batch on one rank when the update reads 16-bit gradients, else fp32)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None] | None


GradFn = Callable[[GradContext, Batch], GradResult]
GradTransform = Callable[[GradFn], GradFn]


def value_and_grad(loss_fn: LossFn | None = None) -> GradFn:
    """Loss and gradients of one micro-batch, through the state's model skeleton.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``; ``model`` is the module bound to the current
        parameters. ``None`` uses the program's loss function (the module itself returns the loss when
        none was given to :func:`dsfunc.init_state`).
    """

    def loss_and_grads(ctx: GradContext, batch: Batch) -> GradResult:
        runtime = ctx.runtime or local_runtime(ctx.state)
        # None: the model itself is called with the batch (see MicroBatchRuntime.forward)
        loss = scalar_loss(loss_in(runtime.forward(loss_fn or ctx.state.program.loss_fn, batch, micro=ctx.micro)))
        runtime.backward(loss, ctx.cotangent)
        runtime.end()
        if ctx.runtime is not None:
            return GradResult(loss.detach().float(), None)
        return GradResult(*runtime.finish())

    return loss_and_grads


def accumulate(steps: int | None = None) -> GradTransform:
    """Split the batch into ``steps`` micro-batches (default: the config's gradient_accumulation_steps);
    the loss and gradients are the mean over micro-batches (summed in fp32)."""

    def transform(inner: GradFn) -> GradFn:
        def accumulated(ctx: GradContext, batch: Batch) -> GradResult:
            config = ctx.state.program.config
            n = steps or config.gradient_accumulation_steps
            micros = split_batch(batch, n, config.train_micro_batch_size_per_gpu if steps is None else None)
            runtime = ctx.runtime or local_runtime(ctx.state)
            for i, micro in enumerate(micros):
                inner(ctx.replace(runtime=runtime, micro=(i, n)), micro)
            if ctx.runtime is not None:
                return GradResult(runtime.mean_loss(), None)
            return GradResult(*runtime.finish())

        return accumulated

    return transform


def scale_loss() -> GradTransform:
    """Multiply the loss by the current loss scale (``state.scaler.scale``) before backward; gradients
    stay scaled and the update unscales them."""

    def scaled(ctx: GradContext) -> GradContext:
        if ctx.state.program.scaler.unscaled:  # bf16 or fp32: a scale of 1 for good, no device op for it
            return ctx
        scale = ctx.state.scaler.scale
        return ctx.replace(cotangent=scale if isinstance(ctx.cotangent, float) and ctx.cotangent == 1.0
                           else ctx.cotangent * scale)

    return _around(scaled, _unchanged)


def shard(mesh: Mesh | DeviceMesh | None = None) -> GradTransform:
    """ZeRO data parallelism at the plan's stage: compute parameters come from the sharded fp32 master
    (gathered per unit at stage 3), and gradients are reduced over ranks into this rank's shard (the
    full gradient at stage 0) as backward produces them. Gradients are the mean over ranks.

    The ranks are the state's mesh's ``dp x sp`` (tensor-parallel parts are each rank's own), the sp ranks'
    gradients added up, not averaged, below ZeRO-3 ([Note: the gradient over sp] in
    :mod:`dsfunc.distributed.mesh`): the mesh is the
    state's, chosen by ``init_state(mesh=...)``; ``mesh`` here names it too, and must be that one."""

    def with_runtime(ctx: GradContext) -> GradContext:
        if mesh is not None:
            ctx.state.program.mesh.check_same(mesh)
        if ctx.runtime is not None or ctx.micro[1] != 1:
            raise UsageError(
                "shard() must be outside accumulate() and value_and_grad(): compose "
                "shard()(accumulate()(value_and_grad(loss_fn))) so one reduction covers every micro-batch"
            )
        return ctx.replace(runtime=zero_runtime(ctx.state))

    return _around(with_runtime, lambda ctx, result: GradResult(*ctx.runtime.finish()))


Enter = Callable[[GradContext], GradContext]
Leave = Callable[[GradContext, GradResult], GradResult]


@dataclasses.dataclass(frozen=True)
class _Around:
    """A gradient function wrapped by transforms that only change the context going in and the result coming
    out (:func:`scale_loss`, :func:`shard`): nested ones run in one call, so a batch reaches the model through
    one frame for them all. ``layers`` are ``(enter, leave)`` pairs, outermost first."""

    inner: GradFn
    layers: tuple[tuple[Enter, Leave], ...]

    def __call__(self, ctx: GradContext, batch: Batch) -> GradResult:
        entered = []
        for enter, _ in self.layers:
            ctx = enter(ctx)
            entered.append(ctx)
        result = self.inner(ctx, batch)
        for (_, leave), inner_ctx in zip(reversed(self.layers), reversed(entered)):
            result = leave(inner_ctx, result)
        return result


def _around(enter: Enter, leave: Leave) -> GradTransform:
    """The transform that runs its gradient function between ``enter`` and ``leave``."""

    def transform(inner: GradFn) -> GradFn:
        if isinstance(inner, _Around):
            return _Around(inner.inner, ((enter, leave), *inner.layers))
        return _Around(inner, ((enter, leave),))

    return transform


def _unchanged(ctx: GradContext, result: GradResult) -> GradResult:
    return result


def default_grad_fn(loss_fn: LossFn | None = None) -> GradFn:
    """``scale_loss(shard(accumulate(value_and_grad(loss_fn))))``: what the config describes."""
    return scale_loss()(shard()(accumulate()(value_and_grad(loss_fn))))


def compute_loss(loss_fn: LossFn | None, model: nn.Module, batch: Batch) -> torch.Tensor:
    """The scalar loss of ``batch``: ``loss_fn(model, batch)``, or the model's own output (a tensor, or a
    mapping/object with a ``loss``) called with the batch's tuple or dict."""
    if loss_fn is not None:
        return scalar_loss(loss_in(loss_fn(model, batch)))
    args, kwargs = model_inputs(batch)
    return scalar_loss(loss_in(model(*args, **kwargs)))
