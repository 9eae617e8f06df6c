"""Sequence tiling: compute a token-wise function (an MLP, the LM head and its loss) a slice of the
sequence at a time, so its activations are one slice's, not the whole sequence's (ALST's tiled compute).

[Note: gradients as outputs] DeepSpeed's ``TiledMLP`` recomputes each slice in backward and calls
``torch.autograd.backward`` there, which accumulates the weights' gradients into ``.grad`` and needs
ZeRO told not to reduce before the last slice (``ds_grad_is_ready``). Here the weights are explicit
inputs of the autograd function and each slice's recompute takes ``torch.autograd.grad`` with respect
to the slice *and* the weights, summed over slices and returned as the weights' gradients. So the
gradients leave through the graph like any other op's, whatever collects them (a plain ``backward``,
``torch.autograd.grad``, ZeRO's reducer, a compiled step), and nothing is reduced twice.

Weights here are whatever tensors ``fn`` reads that need gradients (a module's parameters, or the views
of them a ZeRO unit binds); they may be non-leaf tensors: the gradient is taken at them and flows on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dsfunc.errors import InputError


def default_shards(seq_len: int, hidden: int) -> int:
    """ALST's choice: slices about as long as the model is wide (a slice's MLP activations are then
    about a square of the width)."""
    return max(1, math.ceil(seq_len / max(1, hidden)))


def _check(inputs: Sequence[Tensor], shards: int, dim: int) -> None:
    if not isinstance(shards, int) or shards < 1:
        raise InputError(f"shards must be a positive int, got {shards!r}")
    sizes = {x.shape[dim] for x in inputs}
    if len(sizes) != 1:
        raise InputError(f"the tiled inputs must have one length along dim {dim}, got {sorted(sizes)}")


def _leaves(tensors: Sequence[Tensor], wanted: Sequence[bool]) -> list[Tensor]:
    """Detached copies (same storage) that are leaves of a graph of their own: a slice's recompute is
    differentiated here, never through the graph that called it."""
    return [t.detach().requires_grad_(w) for t, w in zip(tensors, wanted)]


def _add(total: Tensor | None, grad: Tensor | None) -> Tensor | None:
    """Weights' gradients summed over slices in fp32 (each slice adds a partial sum of its tokens)."""
    if grad is None:
        return total
    return grad.float() if total is None else total.add_(grad)


def _cast(grads: Sequence[Tensor | None], like: Sequence[Tensor]) -> list[Tensor | None]:
    return [None if g is None else g.to(w.dtype) for g, w in zip(grads, like)]


class _Tiled(torch.autograd.Function):
    """``cat([fn(*slices_i, *weights) for i], dim)``, recomputed a slice at a time in backward. See [Note:
    gradients as outputs]. With ``passes_weights`` False, ``fn(*slices_i)`` reads the weights itself (a
    closure, as DeepSpeed's ``sequence_tiled_compute`` takes), and the gradient is taken at those very tensors."""

    @staticmethod
    def forward(ctx, fn, shards, dim, passes_weights, n_inputs, *tensors):  # type: ignore[no-untyped-def]
        inputs, weights = tensors[:n_inputs], tensors[n_inputs:] if passes_weights else ()
        ctx.fn, ctx.shards, ctx.dim, ctx.n_inputs, ctx.passes_weights = fn, shards, dim, n_inputs, passes_weights
        ctx.save_for_backward(*tensors)
        slices = [torch.chunk(x, shards, dim=dim) for x in inputs]
        outputs = [fn(*parts, *weights) for parts in zip(*slices)]
        return torch.stack(outputs) if outputs[0].dim() == 0 else torch.cat(outputs, dim=dim)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
        needs = ctx.needs_input_grad[5:]
        tensors = ctx.saved_tensors
        inputs, weights = tensors[: ctx.n_inputs], tensors[ctx.n_inputs:]
        if ctx.passes_weights:
            weights = _leaves(weights, needs[ctx.n_inputs:])
        passed = weights if ctx.passes_weights else ()
        slices = [torch.chunk(x.detach(), ctx.shards, dim=ctx.dim) for x in inputs]
        input_grads: list[list[Tensor]] = [[] for _ in inputs]
        weight_grads: list[Tensor | None] = [None] * len(weights)
        offset = 0
        for k, parts in enumerate(zip(*slices)):
            parts = _leaves(parts, needs[: ctx.n_inputs])
            with torch.enable_grad():
                out = ctx.fn(*parts, *passed)
            if out.dim() == 0:
                g = grad_output[k]
            else:
                g = grad_output.narrow(ctx.dim, offset, out.shape[ctx.dim])
                offset += out.shape[ctx.dim]
            targets = [t for t in (*parts, *weights) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, targets, g, allow_unused=True) if out.requires_grad else
                         [None] * len(targets))
            for i, part in enumerate(parts):
                if part.requires_grad:
                    grad = next(grads)
                    input_grads[i].append(torch.zeros_like(part) if grad is None else grad)
            for j, w in enumerate(weights):
                if w.requires_grad:
                    weight_grads[j] = _add(weight_grads[j], next(grads))
        results = [torch.cat(g, dim=ctx.dim) if g else None for g in input_grads]
        return (None, None, None, None, None, *results, *_cast(weight_grads, weights))


def tiled(fn: Callable[..., Tensor], *inputs: Tensor, shards: int, weights: Sequence[Tensor] = (),
          dim: int = 1) -> Tensor:
    """``fn`` over ``shards`` slices of ``inputs`` along ``dim``, concatenated along ``dim`` (stacked when
    ``fn`` returns a scalar per slice); only one slice's activations are alive at a time, in forward and in
    backward, which recomputes each slice.

    Args:
      fn: ``fn(*slices, *weights) -> Tensor``, token-wise along ``dim`` (a slice's output depends on that
        slice only). The weights are passed in, so the recompute reads the very tensors the forward read.
      inputs: tensors of one length along ``dim``; gradients flow to those that require them.
      shards: the number of slices (``torch.chunk``'s: the last may be shorter, and there may be fewer).
      weights: the tensors ``fn`` computes with that may need gradients (parameters, or their ZeRO views).
      dim: the sequence dimension.

    Example:
      >>> w1, w2 = torch.randn(4, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
      >>> def mlp(x, w1, w2):
      ...     return torch.nn.functional.gelu(x @ w1) @ w2
      >>> x = torch.randn(2, 12, 4, requires_grad=True)
      >>> torch.allclose(tiled(mlp, x, shards=3, weights=(w1, w2)), mlp(x, w1, w2), atol=1e-6)
      True
    """
    _check(inputs, shards, dim)
    dim = dim % inputs[0].dim()
    return _Tiled.apply(fn, shards, dim, True, len(inputs), *inputs, *weights)


def tiled_closure(fn: Callable[..., Tensor], *inputs: Tensor, shards: int, weights: Sequence[Tensor],
                  dim: int = 1) -> Tensor:
    """:func:`tiled` for an ``fn(*slices)`` that reads its weights itself (DeepSpeed's ``sequence_tiled_compute``
    and ``TiledMLP`` take such functions): the gradient is taken at ``weights``, which must be the very tensors
    ``fn`` reads, in forward and in backward."""
    _check(inputs, shards, dim)
    dim = dim % inputs[0].dim()
    return _Tiled.apply(fn, shards, dim, False, len(inputs), *inputs, *weights)


def tiled_module(module: torch.nn.Module, x: Tensor, shards: int, dim: int = -2,
                 call: Callable[..., Tensor] | None = None) -> Tensor:
    """``module(x)`` (or ``call(module, x)``) a slice of ``x`` at a time along ``dim``, with the module's
    parameters that require gradients as the weights."""
    fn, weights = bind(module, call)
    return tiled(fn, x, shards=shards, weights=weights, dim=dim)


def bind(module: torch.nn.Module, call: Callable[..., Tensor] | None = None
         ) -> tuple[Callable[..., Tensor], list[Tensor]]:
    """``(fn, weights)`` for :func:`tiled` and :func:`tiled_loss`: ``fn(*args, *weights)`` is ``module(*args)``
    (or ``call(module, *args)``) with the module's parameters that require gradients replaced by ``weights``
    (``torch.func.functional_call``)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names = [f"inner.{n}" for n, _ in named]
    bound = _Bound(module, call)

    def fn(*args: Tensor) -> Tensor:
        inputs, weights = args[: len(args) - len(names)], args[len(args) - len(names):]
        return torch.func.functional_call(bound, dict(zip(names, weights)), inputs, strict=False)

    return fn, [p for _, p in named]


class _Bound(torch.nn.Module):
    """``call(module, *args)`` as a module holding ``module`` (as ``inner``), for ``functional_call``."""

    def __init__(self, module: torch.nn.Module, call: Callable[..., Tensor] | None) -> None:
        super().__init__()
        self.inner, self.call = module, call

    def forward(self, *args: Tensor) -> Tensor:
        return self.inner(*args) if self.call is None else self.call(self.inner, *args)


def tiled_mlp(mlp: torch.nn.Module, x: Tensor, shards: int | None = None) -> Tensor:
    """``mlp(x)`` for ``x`` of shape ``[..., seq, hidden]``, a slice of the sequence at a time (default: slices
    about ``hidden`` tokens long, ALST's choice)."""
    n = default_shards(x.shape[-2], x.shape[-1]) if shards is None else shards
    return tiled_module(mlp, x, n)


class _TiledLoss(torch.autograd.Function):
    """The sum of ``fn`` over slices, its gradients taken slice by slice *in forward*: the loss ends the
    graph, so nothing needs recomputing, and no slice's logits outlive it."""

    @staticmethod
    def forward(ctx, fn, shards, dim, differentiable, n_inputs, *tensors):  # type: ignore[no-untyped-def]
        inputs = tensors[:n_inputs]
        needs = [differentiable and t.requires_grad for t in tensors]
        weights = _leaves(tensors[n_inputs:], needs[n_inputs:])
        slices = [torch.chunk(x.detach(), shards, dim=dim) for x in inputs]
        total = None
        x_grads: list[Tensor] = []
        weight_grads: list[Tensor | None] = [None] * len(weights)
        for parts in zip(*slices):
            first = parts[0].requires_grad_(needs[0])
            with torch.enable_grad():
                loss = fn(first, *parts[1:], *weights)
            if loss.dim() != 0:
                raise InputError(f"a tiled loss must be a scalar per slice, got shape {tuple(loss.shape)}")
            targets = [t for t in (first, *weights) if t.requires_grad]
            grads = iter(torch.autograd.grad(loss, targets, allow_unused=True) if targets and loss.requires_grad
                         else [None] * len(targets))
            if first.requires_grad:
                grad = next(grads)
                x_grads.append(torch.zeros_like(first) if grad is None else grad)
            for j, w in enumerate(weights):
                if w.requires_grad:
                    weight_grads[j] = _add(weight_grads[j], next(grads))
            total = loss.detach() if total is None else total + loss.detach()
        ctx.n_inputs = n_inputs
        ctx.grads = [torch.cat(x_grads, dim=dim) if x_grads else None, *[None] * (n_inputs - 1),
                     *_cast(weight_grads, weights)]
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
        grads, ctx.grads = ctx.grads, None
        return (None, None, None, None, None, *[None if g is None else g * grad_output.to(g.dtype) for g in grads])


def tiled_loss(fn: Callable[..., Tensor], x: Tensor, *targets: Tensor, shards: int,
               weights: Sequence[Tensor] = (), dim: int = 1) -> Tensor:
    """The sum over ``shards`` slices of ``fn(x_slice, *target_slices, *weights)``, a scalar per slice (a loss
    *summed* over the slice's tokens: divide by the number of counted tokens for a mean that does not depend on
    where the slices fall). Each slice's gradient is taken as it is computed, so one slice's logits at a time
    are alive (ALST's ``TiledFusedLogitsLoss``). ``x`` and the weights get gradients; ``targets`` (labels,
    masks) are sliced alongside ``x``.

    Example:
      >>> head = torch.nn.Linear(4, 10)
      >>> x, y = torch.randn(2, 12, 4), torch.randint(0, 10, (2, 12))
      >>> def loss(h, t, w, b):
      ...     logits = torch.nn.functional.linear(h, w, b)
      ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum")
      >>> weights = (head.weight, head.bias)
      >>> torch.allclose(tiled_loss(loss, x, y, shards=4, weights=weights), loss(x, y, *weights))
      True
    """
    inputs = (x, *targets)
    _check(inputs, shards, dim)
    dim = dim % x.dim()
    return _TiledLoss.apply(fn, shards, dim, torch.is_grad_enabled(), len(inputs), *inputs, *weights)
