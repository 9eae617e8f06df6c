"""Ulysses sequence parallelism: attention over a sequence split across the mesh's ``sp`` ranks.

Each sp rank holds ``seq / sp`` consecutive positions of every head. Around attention an all-to-all trades
them for every position of ``heads / sp`` heads (heads scattered, sequence gathered), attention runs on
whole sequences of its heads, and a second all-to-all trades back (sequence scattered, heads gathered). The
all-to-all is linear, and its adjoint is the all-to-all that undoes it: that is its backward. Everything
outside attention (projections, MLP, norms, the loss) is position-wise and runs on the rank's positions only.

Grouped-query attention keeps each rank's query heads with the key/value heads they read: ``kv_heads`` must be
a multiple of ``sp`` (each rank takes ``kv_heads / sp``), or ``sp`` a multiple of ``kv_heads`` (each key/value
head is repeated ``sp / kv_heads`` times first, so each rank takes one, as DeepSpeed's ALST does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dsfunc.distributed.comm import Group
from dsfunc.errors import InputError


class _AllToAll(torch.autograd.Function):
    """``x`` split in ``group.size`` chunks along ``scatter``, chunk ``j`` sent to rank ``j``, the chunks received
    joined along ``gather`` in rank order; backward is the exchange the other way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scatter: int, gather: int, group: Group) -> Tensor:
        ctx.dims, ctx.group = (scatter, gather), group
        return exchange(x, scatter, gather, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        scatter, gather = ctx.dims
        return exchange(grad, gather, scatter, ctx.group), None, None, None


def exchange(x: Tensor, scatter: int, gather: int, group: Group) -> Tensor:
    """The all-to-all of :func:`all_to_all`, without autograd (one ``all_to_all_single``: gloo has no list form)."""
    if group.size == 1:
        return x
    if x.shape[scatter] % group.size:
        raise InputError(f"Ulysses all-to-all: dim {scatter} of a {tuple(x.shape)} tensor does not split over the "
                         f"{group.size} sequence-parallel ranks")
    parts = torch.stack(x.chunk(group.size, dim=scatter))
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=group.process_group)
    return torch.cat(out.unbind(0), dim=gather)


def all_to_all(x: Tensor, scatter: int, gather: int, group: Group) -> Tensor:
    """Differentiable all-to-all over ``group``: ``x``'s dim ``scatter`` is split over the ranks, dim ``gather``
    grows by the chunks the other ranks send, in rank order."""
    return _AllToAll.apply(x, scatter, gather, group)


def check_heads(heads: int, kv_heads: int, sp: int, tp: int = 1) -> None:
    """Raise unless ``heads`` query heads and ``kv_heads`` key/value heads can be split over ``sp`` ranks (the
    heads of one tensor-parallel rank, of ``tp``: Ulysses splits what tensor parallelism left each rank)."""
    where = f" per tensor-parallel rank (autotp_size {tp})" if tp > 1 else ""
    fix = "sequence_parallel_size" + (" or autotp_size" if tp > 1 else "")
    if heads % sp:
        raise InputError(f"Ulysses sequence parallelism splits attention heads over the sequence_parallel_size: "
                         f"{heads} attention heads{where} do not divide by {sp}; choose a {fix} that leaves a head "
                         "count it divides")
    if kv_heads % sp and sp % kv_heads:
        raise InputError(f"Ulysses sequence parallelism: {kv_heads} key/value heads{where} and sequence_parallel_size "
                         f"{sp} must divide one another (each rank takes kv_heads/sp heads, or each head is repeated "
                         f"sp/kv_heads times); choose another {fix}")


def gather_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Every sp rank's ``x`` joined along ``dim`` in rank order, without gradient (position ids)."""
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.process_group)
    return torch.cat(parts, dim=dim)


# An attention function with Hugging Face's signature:
# attn(module, query, key, value, attention_mask, **kwargs) -> (output [batch, seq, heads, head_dim], weights)
Attention = Callable[..., tuple[Tensor, Any]]


def ulysses(attn: Attention, group: Group, *, in_eval: bool = True) -> Attention:
    """``attn`` (Hugging Face's signature, inputs ``[batch, heads, seq, head_dim]``) over the sequence split
    across ``group``: it sees every position of its ranks' heads, and returns this rank's positions of every
    head. The attention mask is dropped (attention is causal over the gathered sequence, whose position ids are
    gathered for kernels that read them): padding is masked through labels of -100, as in DeepSpeed's ALST. With
    ``in_eval=False`` a module in eval mode runs ``attn`` alone on the whole sequence it was given (DeepSpeed's
    ``disable_in_eval``: evaluation without the split)."""
    inner = getattr(attn, "ulysses_inner", attn)  # never around itself: one exchange per attention

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                  *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        if not (in_eval or module.training):
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        sp = group.size
        check_heads(query.shape[1], key.shape[1], sp)
        repeat = sp // key.shape[1] if key.shape[1] < sp else 1
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        q, k, v = (all_to_all(t, 1, 2, group) for t in (query, key, value))
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = gather_sequence(kwargs["position_ids"], group)
        with _kv_groups(module, q.shape[1] // k.shape[1]):
            out, weights = inner(module, q, k, v, None, *args, **kwargs)
        return all_to_all(out, 1, 2, group), weights  # [batch, seq, heads/sp, d] -> [batch, seq/sp, heads, d]

    attention.ulysses_inner = inner  # type: ignore[attr-defined]
    return attention


@contextlib.contextmanager
def _kv_groups(module: nn.Module, groups: int) -> Iterator[None]:
    """``module.num_key_value_groups`` (which Hugging Face's attention functions repeat key/value heads by) is
    ``groups`` while the local heads run: it changes when key/value heads were repeated for a small head count."""
    before = getattr(module, "num_key_value_groups", None)
    if before is None or before == groups:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = before


class UlyssesAttention(nn.Module):
    """``local_attention(q, k, v, *args, **kwargs)`` on whole sequences of this rank's heads, for models that
    call attention themselves (DeepSpeed's ``DistributedAttention``): ``q``, ``k``, ``v`` and the result hold this
    rank's positions of every head, the sequence along ``seq_dim`` and the heads along ``heads_dim``."""

    def __init__(self, local_attention: Callable[..., Tensor], group: Group) -> None:
        super().__init__()
        self.local_attention = local_attention
        self.group = group

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, seq_dim: int = 1, heads_dim: int = 2,
                **kwargs: Any) -> Tensor:
        check_heads(query.shape[heads_dim], key.shape[heads_dim], self.group.size)
        if key.shape[heads_dim] % self.group.size:
            raise InputError(f"{key.shape[heads_dim]} key/value heads do not split over sequence_parallel_size "
                             f"{self.group.size}: repeat them to a multiple of it before attention")
        q, k, v = (all_to_all(t, heads_dim, seq_dim, self.group) for t in (query, key, value))
        return all_to_all(self.local_attention(q, k, v, *args, **kwargs), seq_dim, heads_dim, self.group)
