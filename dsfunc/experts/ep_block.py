"""The expert-parallel block AutoEP puts in place of a Hugging Face MoE block: the model's own router, then the
tokens dispatched to the ranks that hold their experts, run there as grouped experts, and combined back.

Routing is the model's: the HF router module itself is kept (``gate``), so its top-k softmax, its
``norm_topk_prob`` and the router logits that Transformers records for the load-balancing loss
(``output_router_logits``) are unchanged. No token is dropped, as in the HF block: every expert's buffer has the
capacity of the most tokens any expert gets on any rank of the expert-parallel group, so the all-to-all moves equal
blocks (:mod:`dsfunc.experts.dispatch`); the experts then run on the occupied rows only
(:class:`~dsfunc.experts.grouped.GroupedExperts`).

[Note: experts under tensor parallelism] The ranks of a tensor-parallel group hold the same tokens (attention's
row-parallel output is all-reduced). Each runs the router on all of them, then dispatches only its share of the
rows (``torch.tensor_split`` over the tp ranks), and the combined rows are gathered back, so every token reaches
its experts once per replica. The share-out's backward gathers the shares' gradients and the gather's backward
keeps this rank's share, so the router, and everything before the block, get the whole gradient on every tp rank
(they are replicated over tp), and an expert's gradient is its tokens' once: summed over the ranks holding that
expert (its expert-data-parallel group) with the runtime's ``1 / dp`` seed it is the one-process gradient, whatever
the ep groups' place among the tp groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dsfunc.distributed import comm
from dsfunc.experts import dispatch
from dsfunc.experts.grouped import GroupedExperts
from dsfunc.experts.groups import ExpertGroups, copy_sharing
from dsfunc.experts.routing import largest_count


class ExpertParallelBlock(nn.Module):
    """A sparse MoE block over ``groups.ep_size`` ranks, each holding ``num_experts / ep_size`` experts; ``tp``:
    the tensor-parallel ranks that share its tokens out (see [Note: experts under tensor parallelism]).

    Parameter names are the HF block's (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``), the
    experts' holding this rank's slice of the experts along dim 0.
    """

    def __init__(self, gate: nn.Module, experts: GroupedExperts, num_experts: int, groups: ExpertGroups,
                 jitter_noise: float = 0.0, tp: comm.Group | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_experts = num_experts
        self.groups = groups
        self.jitter_noise = jitter_noise
        self.tp = tp or comm.Group.lone()

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertParallelBlock:
        return copy_sharing(self, memo, self.tp.process_group)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``hidden_states`` ``[..., H]`` through the experts its router picks, weighted by the router's scores."""
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's input jitter, as its block applies it
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        tokens = hidden_states.reshape(-1, shape[-1])
        _, weights, picked = self.gate(tokens)
        if self.tp.size > 1:
            tokens, weights = _ShareOut.apply(tokens, self.tp), _ShareOut.apply(weights, self.tp)
            picked = picked.tensor_split(self.tp.size)[self.tp.rank]
        combined = self._route(tokens, weights, picked)
        if self.tp.size > 1:
            combined = _Gather.apply(combined, self.tp, shape.numel() // shape[-1])
        return combined.reshape(shape)

    def _route(self, tokens: Tensor, weights: Tensor, picked: Tensor) -> Tensor:
        """Each of ``tokens`` ``[T, H]`` through its ``picked`` experts ``[T, k]``, summed by ``weights``."""
        group = self.groups.ep if self.groups.ep_size > 1 else None
        experts = self.num_experts
        chosen = torch.zeros(tokens.size(0), experts, dtype=torch.int64, device=tokens.device).scatter_(1, picked, 1)
        counts = chosen.sum(0)
        capacity = int(largest_count(counts, group))
        locations = (chosen.cumsum(0) - 1).gather(1, picked)
        rows = dispatch.rows_of(picked.t(), locations.t(), experts, capacity)
        received = dispatch.exchange(dispatch.encode(tokens, rows, experts, capacity), group)
        sent = dispatch.exchange(counts.view(experts, 1), group).view(self.groups.ep_size, -1)
        outputs = self._run_experts(received, sent, capacity)
        returned = dispatch.exchange(outputs, group)
        return dispatch.decode(returned.view(experts * capacity, -1), rows, weights.t(), tokens.size(0))

    def _run_experts(self, received: Tensor, sent: Tensor, capacity: int) -> Tensor:
        """The local experts on the rows ``received`` ``[ranks * L, C, H]`` holds (by source rank; ``sent[r, l]``
        rows for local expert ``l`` from rank ``r``), as ``[ranks * L, C, H]`` again, zeros in unused rows."""
        ranks, local = sent.shape
        width = received.size(-1)
        by_expert = received.view(ranks, local, capacity, width).transpose(0, 1).reshape(-1, width)
        used = torch.arange(capacity, device=sent.device) < sent.t().unsqueeze(-1)  # [L, ranks, C]
        rows = used.reshape(-1).nonzero().squeeze(1)
        offsets = sent.sum(0).cumsum(0).to(torch.int32)
        out = self.experts(by_expert.index_select(0, rows), offsets)
        full = out.new_zeros(by_expert.shape).index_copy(0, rows, out)
        return full.view(local, ranks, capacity, width).transpose(0, 1).reshape(ranks * local, capacity, width)


def _gather_rows(share: Tensor, group: comm.Group, rows: int) -> Tensor:
    """Every rank's ``share`` of ``rows`` rows (``torch.tensor_split``'s shares, in rank order), concatenated."""
    sizes = [len(part) for part in torch.empty(rows).tensor_split(group.size)]
    padded = share.new_zeros((sizes[0], *share.shape[1:]))
    padded[: share.size(0)] = share
    every = share.new_empty((group.size, *padded.shape))
    comm.all_gather_flat(every.view(-1), padded.contiguous().view(-1), group)
    return torch.cat([part[:n] for part, n in zip(every.unbind(0), sizes)])


class _ShareOut(torch.autograd.Function):
    """This tp rank's share of the rows; backward gathers every rank's share of the gradient."""

    @staticmethod
    def forward(ctx: Any, whole: Tensor, group: comm.Group) -> Tensor:
        ctx.group, ctx.rows = group, whole.size(0)
        return whole.tensor_split(group.size)[group.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _gather_rows(grad, ctx.group, ctx.rows), None


class _Gather(torch.autograd.Function):
    """Every tp rank's share of the rows, concatenated; backward keeps this rank's share of the gradient (the same
    on every tp rank: what follows the block is replicated over tp)."""

    @staticmethod
    def forward(ctx: Any, share: Tensor, group: comm.Group, rows: int) -> Tensor:
        ctx.group = group
        return _gather_rows(share, group, rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad.tensor_split(ctx.group.size)[ctx.group.rank].contiguous(), None, None
