"""Dispatch and combine: tokens into per-expert buffers of fixed capacity, across the expert-parallel ranks,
and the experts' outputs back to their tokens.

[Note: every expert runs] The buffers have ``capacity`` rows per expert whatever the routing, unused rows
holding zeros, and the all-to-all always moves all of them. So every local expert runs a forward (and its
backward) on every rank in every step, even one no token was routed to: each rank's backward then makes the
same gradients in the same order, which the per-unit gradient reductions of ZeRO rely on (a unit that ran on
some ranks only would leave the others waiting in a different collective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dsfunc.distributed import comm


def rows_of(experts: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Each route's flat row in the ``[E * C]`` buffers; a dropped route's is the scratch row ``E * C``."""
    flat = experts.long() * capacity + locations.long()
    return torch.where(experts >= 0, flat, torch.full_like(flat, num_experts * capacity))


def encode(tokens: Tensor, rows: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The ``[E, C, M]`` buffers holding each routed token in its row (zeros elsewhere): one gather."""
    count, width = tokens.shape
    source = torch.full((num_experts * capacity + 1,), count, dtype=torch.long, device=rows.device)
    order = torch.arange(count, device=rows.device).expand_as(rows)
    source.scatter_(0, rows.reshape(-1), order.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, width)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, width)


def decode(outputs: Tensor, rows: Tensor, weights: Tensor, count: int) -> Tensor:
    """Each token's sum over its routes of the expert output in the route's row times the route's weight."""
    width = outputs.size(-1)
    padded = torch.cat([outputs, outputs.new_zeros(1, width)])
    routed = padded.index_select(0, rows.reshape(-1)).view(rows.size(0), count, width)
    return (routed * weights.unsqueeze(-1)).sum(0).to(outputs.dtype)


class _AllToAll(torch.autograd.Function):
    """Equal chunks of dim 0 to each rank of the group; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, group: torch.distributed.ProcessGroup, inputs: Tensor) -> Tensor:
        ctx.group = group
        inputs = inputs.contiguous()
        out = torch.empty_like(inputs)
        comm.all_to_all(out, inputs, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


def exchange(buffers: Tensor, group: torch.distributed.ProcessGroup | None) -> Tensor:
    """``buffers`` ``[E, C, M]`` with its expert blocks sent to the ranks of ``group`` that own them (each
    gets ``[ranks * local experts, C, M]``, by source rank), differentiably; contiguous as is without a group."""
    return buffers.contiguous() if group is None else _AllToAll.apply(group, buffers)
