"""The vocabulary split over the mesh's tp axis: an embedding and an LM head whose rows (tokens of the vocabulary)
are split, and a cross-entropy over logits split along the vocabulary, so no rank ever holds a token's logits
over the whole vocabulary.

The head is torch's ``ColwiseParallel`` with its output left a DTensor sharded on the last dim (the style
``"vocab_parallel"``); the embedding is torch's ``RowwiseParallel`` over ``nn.Embedding`` (``"embedding_rowwise"``:
each rank looks up the ids in its rows, the partial outputs are summed). The loss is torch's ``loss_parallel``
(a softmax whose max and sum are all-reduced over tp, the target's logit taken by the rank holding it).

[Note: the gradient taken in forward] ``loss_parallel`` wants the backward under its context too, but dsfunc's
step runs backward elsewhere (and a Hugging Face model's loss is called from its forward). The loss ends the
graph, so its gradient with respect to the local logits is taken at once, under the context, and kept; the
backward only scales it (as :mod:`dsfunc.tiling`'s tiled loss does). The fused head + loss
(:func:`dsfunc.kernels.linear_cross_entropy` given ``tp_mesh``) uses the same :func:`sum_and_grad` per chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

from dsfunc.errors import InputError

IGNORE_INDEX = -100  # Hugging Face's label for a token without a loss


def head_style() -> ColwiseParallel:
    """The LM head's split: its weight's rows (the vocabulary) over tp, its logits a DTensor sharded on the
    vocabulary (never gathered)."""
    return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)


def sum_and_grad(local: Tensor, target: Tensor, mesh: DeviceMesh, ignore_index: int) -> tuple[Tensor, Tensor]:
    """The summed cross-entropy of rows of logits split along the vocabulary over the 1-D ``mesh`` (``local``:
    this rank's ``(rows, vocab / tp)``, in fp32 for the softmax), and its gradient with respect to ``local``."""
    leaf = local.detach().float().requires_grad_()
    with loss_parallel(), torch.enable_grad():
        logits = DTensor.from_local(leaf, mesh, [Shard(1)], run_check=False)
        total = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum").to_local()
        (grad,) = torch.autograd.grad(total, leaf)
    return total.detach(), grad


class _CrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of split logits; see [Note: the gradient taken in forward]."""

    @staticmethod
    def forward(ctx, local, target, mesh, ignore_index):  # type: ignore[no-untyped-def]
        total, grad = sum_and_grad(local, target, mesh, ignore_index)
        ctx.grad = grad.to(local.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
        grad, ctx.grad = ctx.grad, None
        return grad * grad_output.to(grad.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: DTensor, target: Tensor, *, ignore_index: int = IGNORE_INDEX,
                                 reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(logits, target)`` for ``logits`` of shape ``(..., vocab)`` held as a DTensor sharded on
    the vocabulary over a 1-D tp mesh (the ``"vocab_parallel"`` head's output), computed on each rank's part:
    a plain 0-d tensor, equal on every tp rank. ``reduction`` is ``"mean"`` (over the rows whose target is not
    ``ignore_index``) or ``"sum"``."""
    placement = logits.placements[0] if isinstance(logits, DTensor) and logits.device_mesh.ndim == 1 else None
    if not isinstance(placement, Shard) or placement.dim % logits.dim() != logits.dim() - 1:
        raise InputError("vocab_parallel_cross_entropy needs logits as a DTensor sharded on the vocabulary (the "
                         "last dim) over a 1-D tp mesh, as the \"vocab_parallel\" head makes them; got "
                         f"{type(logits).__name__} {getattr(logits, 'placements', '')}")
    if reduction not in ("mean", "sum"):
        raise InputError(f'vocab_parallel_cross_entropy: reduction must be "mean" or "sum", got {reduction!r}')
    local = logits.to_local()
    local = local.reshape(-1, local.shape[-1])
    target = target.reshape(-1).to(local.device)
    if target.shape[0] != local.shape[0]:
        raise InputError(f"vocab_parallel_cross_entropy: {target.shape[0]} targets for {local.shape[0]} rows of "
                         "logits")
    total = _CrossEntropy.apply(local, target, logits.device_mesh, ignore_index)
    return total if reduction == "sum" else total / (target != ignore_index).sum()


def causal_lm_loss_function(logits: Any, labels: Tensor, vocab_size: int, num_items_in_batch: Any = None,
                            ignore_index: int = IGNORE_INDEX, shift_labels: Tensor | None = None,
                            **kwargs: Any) -> Tensor:
    """A Hugging Face ``loss_function`` (its ``ForCausalLMLoss``'s arguments and result) over the vocab-split
    logits of a ``"vocab_parallel"`` head."""
    if shift_labels is None:  # token t predicts label t + 1; the last none
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if num_items_in_batch is None:
        return vocab_parallel_cross_entropy(logits.float(), shift_labels, ignore_index=ignore_index)
    total = vocab_parallel_cross_entropy(logits.float(), shift_labels, ignore_index=ignore_index, reduction="sum")
    return total / torch.as_tensor(num_items_in_batch, device=total.device)


def bind_loss(model: nn.Module, head_path: str) -> None:
    """A Hugging Face model whose head at ``head_path`` is vocab-parallel computes its own loss with
    :func:`causal_lm_loss_function` (its default loss would gather the logits)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or head is not model.get_submodule(head_path) or not hasattr(type(model), "loss_function"):
        raise InputError(f'the tp style "vocab_parallel" is for a Hugging Face causal LM\'s output embeddings (its '
                         f"LM head); {head_path!r} is not {type(model).__name__}'s. Use \"colwise\" there")
    model.loss_function = causal_lm_loss_function


def split_head(module: nn.Module) -> DeviceMesh | None:
    """The tp mesh ``module``'s weight is split over by rows (the vocabulary, for a head), or None when whole."""
    split = module.__dict__.get("_dsfunc_tp")
    if split is None:
        return None
    mesh, specs = split
    spec = specs.get("weight")
    if spec is None or not any(isinstance(p, Shard) for p in spec.placements):
        return None
    if tuple(spec.placements) != (Shard(0),):
        raise InputError(f"the LM head is split by {spec.placements}; the fused loss needs its rows (the "
                         'vocabulary) split: give it the tp style "colwise" or "vocab_parallel"')
    return mesh
