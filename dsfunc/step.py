"""The training step, composed from gradient transforms and update transforms.

A **gradient function** maps ``(GradContext, batch) -> GradResult``. Gradient transforms wrap one:

* :func:`value_and_grad` — forward through the hook-free model skeleton, backward with autograd;
* :func:`accumulate` — split the step's batch into micro-batches and sum their gradients;
* :func:`scale_loss` — multiply the backward seed by the loss scale (fp16);
* :func:`shard` — ZeRO: gather parameters for compute, reduce gradients to this rank's shard.

The default composition is ``scale_loss(shard(accumulate(value_and_grad(loss_fn))))``; the update is an
optax-style :class:`~dsfunc.optim.Transform`. :func:`make_train_step` joins both into
``step(state, batch, donate=True) -> state``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from dsfunc.dist import comm
from dsfunc.state import FrozenDict, Metrics, TrainState
from dsfunc.zero import Binding, ShardedBinding

Batch = Any


@dataclasses.dataclass(frozen=True)
class GradContext:
    """What a gradient function needs besides the batch.

    ``cotangent`` seeds backward (``d(cotangent * loss)/dparams``); ``binding`` is set by an outer
    :func:`shard`, which then owns the gradients; ``micro`` is ``(index, count)`` inside :func:`accumulate`.
    """

    state: TrainState
    cotangent: torch.Tensor | float = 1.0
    binding: Binding | None = None
    micro: tuple[int, int] = (0, 1)

    def replace(self, **changes: Any) -> GradContext:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class GradResult:
    """Mean loss (detached), gradients by unit (``None`` where an outer transform owns them)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None] | None


GradFn = Callable[[GradContext, Batch], GradResult]
GradTransform = Callable[[GradFn], GradFn]


# --------------------------------------------------------------------------------------------------
# gradient transforms


def value_and_grad(loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor] | None = None) -> GradFn:
    """Loss and gradients of one micro-batch, through the state's model skeleton.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``; ``model`` is the module bound to the current
        parameters. ``None`` uses the program's loss function (the module itself returns the loss when
        none was given to :func:`dsfunc.init_state`).
    """

    def grad_fn(ctx: GradContext, batch: Batch) -> GradResult:
        program = ctx.state.program
        binding = ctx.binding or Binding(program, _full_params_for_local(ctx.state))
        batch = program.to_device(batch)
        binding.begin_micro(*ctx.micro)
        restore_buffers = program.bind_buffers(ctx.state.buffers)
        try:
            with program.rng_scope(ctx.state, ctx.micro[0]):
                loss = program.compute_loss(loss_fn or program.loss_fn, batch)
                if not binding.leaves or loss.grad_fn is None:
                    raise ValueError(
                        "the loss does not depend on any trainable parameter of the model; check loss_fn "
                        "(it must use the `model` it receives, not the original module)"
                    )
                torch.autograd.backward(loss * ctx.cotangent, inputs=binding.leaves)
        finally:
            binding.end_micro()
            restore_buffers()
        grads = None if ctx.binding is not None else binding.finish()
        return GradResult(loss.detach().float(), grads)

    return grad_fn


def accumulate(steps: int | None = None) -> GradTransform:
    """Split the batch into ``steps`` micro-batches (default: the config's gradient_accumulation_steps)
    and sum their gradients in fp32; the loss and gradients are the mean over micro-batches."""

    def transform(inner: GradFn) -> GradFn:
        def grad_fn(ctx: GradContext, batch: Batch) -> GradResult:
            config = ctx.state.program.config
            n = steps or config.gradient_accumulation_steps
            micros = split_batch(batch, n, config.train_micro_batch_size_per_gpu if steps is None else None)
            loss_sum, grads = None, None
            for i, micro in enumerate(micros):
                r = inner(ctx.replace(cotangent=ctx.cotangent / n, micro=(i, n)), micro)
                loss_sum = r.loss if loss_sum is None else loss_sum + r.loss
                grads = _add_grads(grads, r.grads)
            return GradResult(loss_sum / n, grads)

        return grad_fn

    return transform


def scale_loss() -> GradTransform:
    """Seed backward with the current loss scale (``state.scaler.scale``); gradients stay scaled and
    the update unscales them."""

    def transform(inner: GradFn) -> GradFn:
        def grad_fn(ctx: GradContext, batch: Batch) -> GradResult:
            return inner(ctx.replace(cotangent=ctx.cotangent * ctx.state.scaler.scale), batch)

        return grad_fn

    return transform


def shard() -> GradTransform:
    """ZeRO data parallelism at the plan's stage: compute parameters come from the sharded fp32 master
    (gathered per unit at stage 3), and gradients are reduced over ranks into this rank's shard (the
    full gradient at stage 0) as backward produces them. Gradients are the mean over ranks."""

    def transform(inner: GradFn) -> GradFn:
        def grad_fn(ctx: GradContext, batch: Batch) -> GradResult:
            program = ctx.state.program
            binding = ShardedBinding(program, ctx.state.params)
            r = inner(ctx.replace(binding=binding, cotangent=ctx.cotangent / program.plan.world_size), batch)
            return GradResult(r.loss, binding.finish())

        return grad_fn

    return transform


def default_grad_fn(loss_fn: Callable[..., torch.Tensor] | None = None) -> GradFn:
    """``scale_loss(shard(accumulate(value_and_grad(loss_fn))))``: what the config describes."""
    return scale_loss()(shard()(accumulate()(value_and_grad(loss_fn))))


# --------------------------------------------------------------------------------------------------
# the step


def make_train_step(
    grad_fn: GradFn | None = None,
    optimizer: Any = None,
) -> Callable[..., TrainState]:
    """Join a gradient function and an update transform into ``step(state, batch, donate=True)``.

    Args:
      grad_fn: a composed gradient function (default :func:`default_grad_fn`). It must return
        gradients laid out like ``state.params`` (wrap it in :func:`shard` for that).
      optimizer: an update transform over ``state.params`` (default: the state's own, from the config:
        unscale, clip by global norm, then the configured optimizer and schedule). ``state.opt_state``
        must come from its ``init``: pass the same transform to ``init_state(optimizer=...)``.

    Returns:
      A function like :func:`train_step`. Install it with ``state.program.with_step(fn)`` or call it directly.
    """
    grad_fn = grad_fn or default_grad_fn()

    def step(state: TrainState, batch: Batch, donate: bool = True) -> TrainState:
        return _run_step(state, batch, donate, grad_fn, optimizer)

    return step


def train_step(state: TrainState, batch: Batch, *, donate: bool = True) -> TrainState:
    """One optimizer step: ``state`` in, new state out.

    ``batch`` is this rank's data for the whole step: ``micro_batch * gradient_accumulation_steps``
    samples along dim 0 (any pytree of tensors), or a list of ``gradient_accumulation_steps``
    micro-batches. With ``donate=True`` (the default) the returned state reuses ``state``'s buffers and
    ``state`` may not be used again; ``donate=False`` keeps it intact at the cost of a copy.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"train_step expects a TrainState from dsfunc.init_state, got {type(state).__name__}")
    state.check_usable()
    return state.program.step_fn(state, batch, donate)


def _run_step(state: TrainState, batch: Batch, donate: bool, grad_fn: GradFn, optimizer: Any) -> TrainState:
    state.check_usable()
    state.program.check_scaler(state)
    work = state if donate else optree.tree_map(lambda t: t.clone(), state)
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
    optimizer: Any = None,
) -> TrainState:
    """The update half of a step: norm, overflow check, optimizer, loss scaler, metrics.

    ``grads`` are this rank's reduced fp32 gradients laid out like ``state.params`` (still multiplied
    by the loss scale); ``loss`` is this rank's mean loss. Updates ``state``'s buffers in place (the
    caller donates it) and returns the new state. On a non-finite gradient nothing changes but the
    scaler and the metrics (``skipped = 1``), on every rank alike.
    """
    program = state.program
    params = state.params
    grads = {name: g if g is not None else torch.zeros_like(params[name]) for name, g in (grads or {}).items()}
    if grads.keys() != params.keys():
        raise ValueError(
            "the gradient function returned gradients for units "
            f"{sorted(grads)} but the state holds {sorted(params)}; wrap it in dsfunc.shard()"
        )

    sumsq = program.sum_of_squares(list(grads.values()))
    if program.plan.world_size > 1:  # one tiny collective: shard norms and the loss mean
        packed = torch.stack([sumsq if program.plan.ways > 1 else torch.zeros_like(sumsq), loss.float()])
        comm.all_reduce_sum(packed)
        sumsq = packed[0] if program.plan.ways > 1 else sumsq
        loss = packed[1] / program.plan.world_size
    scale = state.scaler.scale
    finite = torch.isfinite(sumsq)
    grad_norm = sumsq.sqrt() / scale

    if optimizer is None and program.fused is not None:  # one in-place pass per unit
        lowp = program.workspace.lowp_targets()
        opt_state = program.fused.update(
            params, grads, state.opt_state, loss_scale=scale, grad_norm=grad_norm, finite=finite, lowp=lowp,
        )
        program.workspace.refresh(params, written=lowp)
    else:
        updates, new_opt_state = (optimizer or program.optimizer).update(
            grads, state.opt_state, dict(params),
            grad_scale=1.0 / scale, global_norm=grad_norm, segment_norm=program.segment_norm,
        )
        new_params = program.apply_updates(params, updates)

        def commit(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return torch.where(finite, new, old, out=old)

        params = FrozenDict({k: commit(params[k], new_params[k]) for k in params})
        opt_state = optree.tree_map(commit, state.opt_state, new_opt_state)
        program.workspace.refresh(params)
    scaler = program.scaler.update(state.scaler, ~finite)
    metrics = Metrics(
        loss=loss.detach(), grad_norm=grad_norm.detach(), loss_scale=scale.detach().clone(),
        lr=program.current_lr(opt_state), skipped=(~finite).to(torch.int32),
    )
    new = dataclasses.replace(
        state, step=state.step + 1, params=params, opt_state=opt_state, scaler=scaler, metrics=metrics,
    )
    program.note_scaler(new)
    return new


# --------------------------------------------------------------------------------------------------
# batches


def split_batch(batch: Batch, count: int, micro_size: int | None) -> list[Batch]:
    """``count`` micro-batches from a step's batch (a pytree split on dim 0, or a list of micro-batches)."""
    if isinstance(batch, list) and batch and not any(isinstance(b, torch.Tensor) for b in batch):
        if len(batch) != count:
            raise ValueError(
                f"got a list of {len(batch)} micro-batches, but gradient_accumulation_steps is {count}"
            )
        for micro in batch:
            split_batch(micro, 1, micro_size)
        return batch
    leaves = [t for t in optree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise TypeError(
            f"the batch holds no tensors (got {type(batch).__name__}); pass a tensor, a tuple or dict of "
            "tensors with samples along dim 0, or a list of gradient_accumulation_steps micro-batches"
        )
    sizes = {tuple(t.shape[:1]) for t in leaves}
    if len(sizes) != 1 or not next(iter(sizes)):
        raise ValueError(
            "every tensor in the batch must have the same number of samples along dim 0; got shapes "
            f"{[tuple(t.shape) for t in leaves]}"
        )
    total = leaves[0].shape[0]
    expected = None if micro_size is None else micro_size * count
    if (expected is not None and total != expected) or total % count:
        raise ValueError(
            f"the batch has {total} samples along dim 0, but one optimizer step on this rank takes "
            f"train_micro_batch_size_per_gpu ({micro_size}) x gradient_accumulation_steps ({count}) = "
            f"{expected} samples. Pass a batch of {expected} samples (or a list of {count} micro-batches), "
            "or change the config's batch sizes."
            if expected is not None
            else f"the batch has {total} samples, not divisible into {count} micro-batches"
        )
    if count == 1:
        return [batch]
    size = total // count
    return [
        optree.tree_map(lambda t, i=i: t[i * size : (i + 1) * size] if isinstance(t, torch.Tensor) else t, batch)
        for i in range(count)
    ]


def _add_grads(acc: dict | None, new: dict | None) -> dict | None:
    if new is None:
        return acc
    if acc is None:
        return dict(new)
    return {k: acc[k] if new[k] is None else new[k] if acc[k] is None else acc[k] + new[k] for k in acc}


def _full_params_for_local(state: TrainState) -> Mapping[str, torch.Tensor]:
    """Unsharded compute flats for a gradient function run without :func:`shard` (one process)."""
    program = state.program
    if program.plan.ways != 1:
        raise ValueError(
            "value_and_grad without shard() needs unsharded parameters, but this state is sharded "
            f"(ZeRO stage {program.plan.stage} over {program.plan.world_size} ranks); wrap it in dsfunc.shard()"
        )
    return {name: p.to(program.compute_dtype) for name, p in state.params.items()}
