"""A causal-LM batch split along the sequence over the mesh's ``sp`` ranks, and its loss: the mean over the
global tokens.

[Note: the loss over a split sequence] Labels are shifted before the split (``shift_labels``: the label of
position ``t`` is token ``t + 1``; the last position's is -100), so the token that crosses a rank boundary is
predicted once, by the rank holding the position before it. Each rank's loss is the sum over its valid tokens
divided by the micro-batch's valid tokens over all its sp ranks (known on every rank: each has the whole
micro-batch before the split), and the ranks' losses are summed by an all-reduce. So every sp rank reports the
micro-batch's mean, and a rank whose positions are all padding contributes 0 (not 0/0). What each rank
backpropagates follows the runtime's divisor ([Note: the gradient over sp] in :mod:`dsfunc.distributed.mesh`): at
ZeRO 0-2, whose gradients add up over sp, its own tokens' share of the mean (the backward passes the seed
through); at ZeRO-3, which averages over sp, the whole mean (the backward sums the ranks' seeds, the all-reduce's
adjoint). Either way the step's gradient is one process's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsfunc.batch import LossFn
from dsfunc.distributed.comm import Group
from dsfunc.errors import InputError

IGNORE = -100  # the label no loss is counted for (torch's and Hugging Face's ignore_index)


def shift_labels(labels: Tensor) -> Tensor:
    """``labels`` moved one position left, -100 at the end: position ``t``'s target is token ``t + 1``."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:].contiguous()


def split_sequence(batch: Mapping[str, Any], rank: int, size: int) -> dict[str, Any]:
    """Rank ``rank``'s consecutive ``seq / size`` positions of a ``[batch, seq]`` causal-LM batch: every tensor
    with the ``input_ids``' sequence length sliced along dim 1, ``labels`` replaced by ``shift_labels`` (shifted
    before the split), ``position_ids`` added when missing (rotary embeddings need the global positions),
    anything else kept. A padding ``attention_mask`` is refused: attention is causal over the whole sequence."""
    if "input_ids" not in batch or not isinstance(batch["input_ids"], Tensor) or batch["input_ids"].dim() != 2:
        raise InputError("sequence parallelism splits a dict batch with input_ids of shape [batch, seq]; got "
                         f"{sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}")
    ids = batch["input_ids"]
    seq = ids.shape[1]
    if seq % size:
        raise InputError(f"a sequence of {seq} tokens does not split over sequence_parallel_size {size}: pad the "
                         f"sequences to a multiple of {size} (with labels -100)")
    out = dict(batch)
    mask = out.pop("attention_mask", None)
    if isinstance(mask, Tensor) and not bool(mask.bool().all()):
        raise InputError("sequence parallelism attends causally over the whole sequence and ignores "
                         "attention_mask: right-pad instead, with labels -100 on the padding (or pack sequences "
                         "with position_ids restarting per document for a kernel that reads them)")
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq, device=ids.device).expand(ids.shape[0], seq)
    if "labels" in out:
        out["shift_labels"] = shift_labels(out.pop("labels"))
    chunk = seq // size
    for key, value in out.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[0] == ids.shape[0]:
            if value.shape[1] != seq:
                raise InputError(f"batch[{key!r}] has shape {tuple(value.shape)}: sequence parallelism splits "
                                 f"every [batch, seq] tensor, and input_ids has {seq} positions")
            out[key] = value[:, rank * chunk:(rank + 1) * chunk].contiguous()
    return out


class _SumOver(torch.autograd.Function):
    """The sum of ``x`` over ``group``'s ranks; backward sums the incoming gradients the same way when ``whole``,
    else passes this rank's through (the sum's other terms held constant)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, whole: bool) -> Tensor:
        ctx.group, ctx.whole = group, whole
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return (_all_reduce(grad.clone(), ctx.group) if ctx.whole else grad), None, None


def _all_reduce(x: Tensor, group: Group) -> Tensor:
    if group.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.process_group)
    return x


def sum_over(x: Tensor, group: Group, *, whole: bool) -> Tensor:
    """The sum of ``x`` over ``group``, differentiable as a sum (``whole``) or as this rank's share of it (see
    [Note: the loss over a split sequence])."""
    return _SumOver.apply(x, group, whole)


def token_loss(logits: Tensor, labels: Tensor, count: Tensor) -> Tensor:
    """Cross-entropy summed over the valid (not -100) ``labels`` and divided by ``count``: in fp32, as Hugging
    Face's causal-LM loss."""
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                            ignore_index=IGNORE, reduction="sum")
    return total / count


def sequence_parallel_loss(loss_fn: LossFn | None, group: Group, *, whole: bool) -> LossFn:
    """``loss_fn`` over the sequence split across ``group``: it gets this rank's :func:`split_sequence` of the
    micro-batch with ``num_items_in_batch`` (the micro-batch's valid tokens, over every sp rank) and returns its
    tokens' loss sum divided by that (Hugging Face's loss functions do, given ``shift_labels`` and
    ``num_items_in_batch``). Without ``loss_fn`` the model's ``logits`` for the rank's positions give it. The
    result is the micro-batch's mean on every sp rank; its backward gives this rank the whole mean's gradient
    (``whole``: ZeRO-3) or its share's ([Note: the loss over a split sequence])."""

    def loss(model: nn.Module, batch: Any) -> Tensor:
        if not isinstance(batch, Mapping) or "labels" not in batch:
            raise InputError("sequence parallelism needs a dict batch with input_ids and labels (the loss is the "
                             "mean over the sequence's tokens, split over the sp ranks)")
        count = (shift_labels(batch["labels"]) != IGNORE).sum()
        shard = split_sequence(batch, group.rank, group.size)
        if loss_fn is not None:
            local = loss_fn(model, {**shard, "num_items_in_batch": count})
        else:
            labels = shard.pop("shift_labels")
            out = model(**shard)
            logits = out["logits"] if isinstance(out, Mapping) else getattr(out, "logits", out)
            local = token_loss(logits, labels, count.clamp(min=1))
        return sum_over(local.reshape(()), group, whole=whole)

    return loss
