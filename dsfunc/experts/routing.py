"""Routing: which experts (and rows of their buffers) take each token, as DeepSpeed 0.19.8's gates decide.

A gate turns the router's fp32 logits ``[S, E]`` into :class:`Routes`: for each of the ``k`` routes of each
token its expert (``-1``: dropped for lack of capacity), its position in that expert's buffer of ``capacity``
rows, and its combine weight; plus the load-balancing loss ``l_aux`` and the tokens each expert was picked
for (before dropping). Capacity is ``ceil(S / E * capacity_factor)`` (``x k`` for k > 1), at least
``min_capacity``; without token dropping it is the largest expert count over the expert-parallel group, so
every rank's buffers have one shape (the all-to-all needs it). The arithmetic follows DeepSpeed's op for op,
so the results agree to the last bit on the same inputs and random stream.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dsfunc.distributed import comm
from dsfunc.errors import InputError


class Routes(NamedTuple):
    """A gate's decision for ``S`` tokens with ``k`` routes each (``[k, S]`` tensors)."""

    l_aux: Tensor  # the load-balancing loss
    capacity: int  # rows per expert
    experts: Tensor  # int32, the expert of each route, -1 where the route was dropped
    locations: Tensor  # int32, the route's row in its expert's buffer
    weights: Tensor  # the route's combine weight
    exp_counts: Tensor  # tokens routed to each expert, before dropping


def gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel noise from the global random stream (what DeepSpeed's RSample and top-2 sampling draw)."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def uniform(shape: torch.Size, device: torch.device, low: float, high: float) -> Tensor:
    """Uniform noise in ``[low, high)`` from the global random stream."""
    bounds = torch.tensor(low, device=device), torch.tensor(high, device=device)
    return torch.distributions.uniform.Uniform(*bounds).rsample(shape)


def capacity(gates: Tensor, capacity_factor: float, min_capacity: int) -> Tensor:
    """Rows per expert: ``ceil(tokens / experts * capacity_factor)`` (in fp32, as DeepSpeed), at least
    ``min_capacity``."""
    tokens, experts = gates.shape
    rows = torch.ceil((tokens / experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return torch.maximum(rows, torch.tensor(min_capacity).to(torch.int64))


def largest_count(exp_counts: Tensor, ep_group: torch.distributed.ProcessGroup | None) -> Tensor:
    """The capacity without dropping: the largest expert count over the expert-parallel ranks."""
    most = torch.max(exp_counts)
    if ep_group is not None:
        comm.all_reduce_max(most, ep_group)
    return most


def top1(logits: Tensor, capacity_factor: float, min_capacity: int, *, used_token: Tensor | None = None,
         rsample: bool = False, drop_tokens: bool = True, use_rts: bool = True,
         ep_group: torch.distributed.ProcessGroup | None = None) -> Routes:
    """Each token to its best expert (by noisy logits with ``rsample``); over capacity, the tokens kept are
    chosen at random (``use_rts``) or first come."""
    if rsample:
        noisy = logits + gumbel(logits.shape, logits.device)
    gates = F.softmax(logits, dim=1)
    rows = capacity(gates, capacity_factor, min_capacity)
    chosen = torch.argmax(noisy if rsample else gates, dim=1)
    num_experts = int(gates.shape[1])
    mask = F.one_hot(chosen, num_classes=num_experts)
    if used_token is not None:
        mask = torch.einsum("s,se->se", used_token, mask)
    exp_counts = torch.sum(mask, dim=0).detach()
    if not drop_tokens:
        rows = torch.minimum(largest_count(exp_counts, ep_group), torch.tensor(mask.size(0)))
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts
    ranked = mask * uniform(mask.shape, logits.device, 0.0, 1.0) if use_rts else mask
    if logits.shape[0] < min_capacity:
        raise InputError(f"the MoE gate got {logits.shape[0]} tokens, fewer than min_capacity={min_capacity}: "
                         "pass more tokens per step or a smaller min_capacity (0 is allowed)")
    kept = torch.topk(ranked, k=int(min(int(rows), mask.size(0))), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, kept, 1)
    chosen = torch.min(chosen, mask.sum(dim=1) * num_experts - 1)
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    weights = (gates * mask).sum(dim=1)
    return Routes(l_aux, int(rows), chosen.to(torch.int32).unsqueeze(0), locations.to(torch.int32).unsqueeze(0),
                  weights.unsqueeze(0), exp_counts)


def top2(logits: Tensor, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
         ep_group: torch.distributed.ProcessGroup | None = None, sample_second: bool = True) -> Routes:
    """Each token to its two best experts (the second by Gumbel-noisy logits with ``sample_second``), weights
    renormalised over the two; over capacity, the later tokens are dropped (first routes before second)."""
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(first, num_classes=num_experts)
    if sample_second:
        logits = logits + gumbel(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        rows = capacity(gates, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, rows)
        mask2 = mask2 * torch.lt(locations2, rows)
    else:
        rows = largest_count(exp_counts, ep_group)
    where1 = torch.sum(locations1 * mask1, dim=1)
    where2 = torch.sum(locations2 * mask2, dim=1)
    weight1 = torch.einsum("se,se->s", gates, mask1.float())
    weight2 = torch.einsum("se,se->s", gates, mask2.float())
    total = torch.clamp(weight1 + weight2, min=torch.finfo(weight1.dtype).eps)
    weight1, weight2 = weight1 / total, weight2 / total
    first = torch.where(mask1.any(dim=1), first, torch.full_like(first, -1))
    second = torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))
    return Routes(l_aux, int(rows), torch.stack([first, second]).to(torch.int32),
                  torch.stack([where1, where2]).to(torch.int32), torch.stack([weight1, weight2]), exp_counts)


def topk(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
         ep_group: torch.distributed.ProcessGroup | None = None) -> Routes:
    """Each token to its ``k`` best experts, weights renormalised over them; over capacity, each expert keeps
    the tokens that weigh most for it."""
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    best, picked = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, picked, 1)
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        rows = capacity(gates, capacity_factor * k, min_capacity)
        weighed = torch.zeros_like(gates).scatter(1, picked, best)
        _, kept = torch.topk(weighed, k=int(min(int(rows), gates.size(0))), dim=0, sorted=False)
        mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, kept, True)
    else:
        rows = largest_count(exp_counts, ep_group)
    locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(torch.sum(masked, dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    routed = mask.gather(1, picked)
    experts = torch.where(routed, picked, torch.full_like(picked, -1))
    return Routes(l_aux, int(rows), experts.t().contiguous().to(torch.int32),
                  (locations.gather(1, picked) * routed).t().contiguous().to(torch.int32),
                  masked.gather(1, picked).t().contiguous(), exp_counts)
