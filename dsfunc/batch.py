"""A step's batch: ``micro x accumulation`` samples along dim 0, or a list of micro-batches.

``batch`` is this rank's data for one optimizer step: any pytree of tensors whose leaves share dim 0
(a tuple, a dict), or a list of ``gradient_accumulation_steps`` micro-batches. Anything else is an
error that names the sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import nn

from dsfunc.errors import InputError, InputTypeError

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]  # loss_fn(model, batch) -> a scalar


def model_inputs(batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` a model without a ``loss_fn`` is called with: a dict's items by name, a tuple's or
    list's by position, anything else as the one argument."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def loss_in(out: Any) -> Any:
    """The loss in a forward's output: the output itself, or its ``loss`` (a mapping's item, an object's
    attribute, as a Hugging Face output holds it)."""
    return out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)


def scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` as a 0-d tensor: the one check every client's loss passes (the functional step's, the engine's
    backward, a pipeline's last stage)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        raise InputError(
            f"the loss must be a scalar floating-point tensor, got {what}: reduce it over the batch (e.g. .mean()) "
            "in loss_fn, or in the model when it returns the loss itself (a tensor, or an object or mapping with "
            ".loss)"
        )
    return loss.reshape(())


def split_batch(batch: Batch, count: int, micro_size: int | None) -> list[Batch]:
    """``count`` micro-batches from a step's batch (a pytree split on dim 0, or a list of micro-batches)."""
    leaves = [t for t in optree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise InputTypeError(
            f"the batch holds no tensors (got {_describe(batch)}); pass a tensor, a tuple or dict of "
            "tensors with samples along dim 0, or a list of gradient_accumulation_steps micro-batches"
        )
    if any(t.is_meta for t in leaves):
        raise InputError(
            f"the batch holds tensors on the meta device, which have shapes but no data (shapes "
            f"{[tuple(t.shape) for t in leaves if t.is_meta]}); pass tensors with data, on the CPU or the "
            "state's device"
        )
    if isinstance(batch, list) and not any(isinstance(b, torch.Tensor) for b in batch):
        if len(batch) != count:
            raise InputError(
                f"got a list of {len(batch)} micro-batches, but gradient_accumulation_steps is {count}"
            )
        for micro in batch:
            split_batch(micro, 1, micro_size)
        return batch
    sizes = {tuple(t.shape[:1]) for t in leaves}
    if len(sizes) != 1 or not next(iter(sizes)):
        raise InputError(
            "every tensor in the batch must have the same number of samples along dim 0; got shapes "
            f"{[tuple(t.shape) for t in leaves]}"
        )
    total = leaves[0].shape[0]
    expected = None if micro_size is None else micro_size * count
    if (expected is not None and total != expected) or total % count:
        raise InputError(
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


def _describe(batch: Batch) -> str:
    """``str``, or ``list of 64 int`` for a container: what a batch without tensors was made of."""
    name = type(batch).__name__
    if isinstance(batch, (list, tuple, dict)) and batch:
        items = batch.values() if isinstance(batch, dict) else batch
        return f"{name} of {len(batch)} {', '.join(sorted({type(b).__name__ for b in items}))}"
    return name
