"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ALST's tiled compute (``TiledMLP``,
``TiledFusedLogitsLoss``, ``sequence_tiled_compute``) with DeepSpeed's signatures, on :mod:`dsfunc.tiling`.

DeepSpeed's versions accumulate the weights' gradients into ``.grad`` inside their backward and need ZeRO
told when the last slice is done (``compute_params``, ``ds_grad_is_ready``); dsfunc's return them through the
graph (see [Note: gradients as outputs] in :mod:`dsfunc.tiling`), so ``compute_params`` only names the weights
a closure reads. The sequence-parallel pieces of the module (Ulysses attention, its data-loader adapter) are
not in dsfunc yet and raise :class:`~dsfunc.errors.NotSupportedError` when used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dsfunc.errors import InputError, unsupported
from dsfunc.tiling import bind, tiled, tiled_closure, tiled_loss


class TiledMLP:
    """``TiledMLP.apply(fn, module, x, shards, compute_params)``: ``fn(module, x)`` a slice of the sequence
    (dim -2) at a time; every parameter of ``module`` that requires a gradient gets it."""

    @staticmethod
    def apply(fn: Callable[[torch.nn.Module, Tensor], Tensor], module: torch.nn.Module, x: Tensor, shards: int,
              compute_params: Sequence[Tensor] | None = None) -> Tensor:
        call, weights = bind(module, fn)
        return tiled(call, x, shards=shards, weights=weights, dim=-2)


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``: the
    mean (or sum) of ``fn(module, x_slice, y_slice[, mask_slice])`` over slices of the flattened batch and
    sequence, each slice's gradient taken as it is computed, as DeepSpeed's. The weights' gradients are scaled
    by the loss's incoming gradient as ``x``'s are (DeepSpeed's are not: they are right only when it is 1, e.g.
    not under a loss scale)."""

    @staticmethod
    def apply(fn: Callable[..., Tensor], module: torch.nn.Module, x: Tensor, y: Tensor, mask: Tensor | None,
              shards: int, compute_params: Sequence[Tensor] | None = None,
              output_reduction: str = "mean") -> Tensor:
        if output_reduction not in ("mean", "sum"):
            raise InputError(f'unknown output_reduction {output_reduction!r}: use "mean" or "sum"')
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise InputError(f"x and y must be [batch, seq, ...] of one batch and sequence, got {tuple(x.shape)} "
                             f"and {tuple(y.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise InputError(f"mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        call, weights = bind(module, fn)
        flat = [t.reshape(-1, *t.shape[2:]) for t in (x, y, mask) if t is not None]
        total = tiled_loss(call, *flat, shards=shards, weights=weights, dim=0)
        return total / len(torch.chunk(flat[0], shards)) if output_reduction == "mean" else total


def sequence_tiled_compute(fn: Callable[..., Tensor], seqlen: int, shards: int, kwargs_to_shard: Mapping[str, Tensor],
                           kwargs_to_pass: Mapping[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Sequence[Tensor] | None = None, output_unshard_dimension: int = 1,
                           output_reduction: str | None = "mean") -> Tensor:
    """``fn(**slices, **kwargs_to_pass)`` over slices of ``kwargs_to_shard`` along dim 1, its outputs joined
    along ``output_unshard_dimension`` (stacked along 0: a scalar per slice) and reduced as DeepSpeed's. Only
    ``kwargs_to_shard[grad_requiring_tensor_key]`` gets a gradient, and the weights ``fn`` reads must be listed in
    ``compute_params`` to get theirs (DeepSpeed without ZeRO finds them through ``.grad``; dsfunc returns them
    through the graph)."""
    if output_reduction not in (None, "mean", "sum"):
        raise InputError(f'unknown output_reduction {output_reduction!r}: use None, "mean" or "sum"')
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise InputError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of kwargs_to_shard's "
                         f"keys {sorted(kwargs_to_shard)}")
    keys = [grad_requiring_tensor_key, *(k for k in kwargs_to_shard if k != grad_requiring_tensor_key)]
    inputs = [kwargs_to_shard[keys[0]], *(kwargs_to_shard[k].detach() for k in keys[1:])]
    for k, v in zip(keys, inputs):
        if v.shape[1] != seqlen:
            raise InputError(f"kwargs_to_shard[{k!r}] has {v.shape[1]} positions along dim 1, not seqlen={seqlen}")

    def call(*parts: Tensor) -> Tensor:
        return fn(**dict(zip(keys, parts)), **kwargs_to_pass)

    weights = [p for p in compute_params or () if p.requires_grad]
    out = tiled_closure(call, *inputs, shards=shards, weights=weights, dim=1)
    if output_unshard_dimension != 1 and out.dim() > 1:
        raise InputError("output_unshard_dimension must be 1 (the sequence) or 0 (a scalar per slice), got "
                         f"{output_unshard_dimension}")
    if output_reduction == "mean":
        return out.mean()
    return out.sum() if output_reduction == "sum" else out


class SequenceTiledCompute:
    """DeepSpeed's autograd function behind :func:`sequence_tiled_compute`, with its positional order."""

    @staticmethod
    def apply(fn: Callable[..., Tensor], seqlen: int, shards: int, keys_to_shard: Sequence[str],
              keys_to_pass: Sequence[str], grad_requiring_tensor_key: str, compute_params: Sequence[Tensor] | None,
              output_unshard_dimension: int, output_reduction: str | None, *args: Any) -> Tensor:
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        return sequence_tiled_compute(fn, seqlen, shards, sharded, passed, grad_requiring_tensor_key, compute_params,
                                      output_unshard_dimension, output_reduction)


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    return unsupported(f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name}", "Ulysses sequence parallelism")
