"""The expert-parallel block AutoEP puts in place of a Hugging Face MoE block: the model's own router, then the
tokens dispatched to the ranks that hold their experts, run there as grouped experts, and combined back.

Routing is the model's: the HF router module itself is kept (``gate``), so its top-k softmax, its
``norm_topk_prob`` and the router logits that Transformers records for the load-balancing loss
(``output_router_logits``) are unchanged. No token is dropped, as in the HF block: every expert's buffer has the
capacity of the most tokens any expert gets on any rank of the expert-parallel group, so the all-to-all moves equal
blocks (:mod:`dsfunc.experts.dispatch`); the experts then run on the occupied rows only
(:class:`~dsfunc.experts.grouped.GroupedExperts`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsfunc.experts import dispatch
from dsfunc.experts.grouped import GroupedExperts
from dsfunc.experts.groups import ExpertGroups
from dsfunc.experts.routing import largest_count


class ExpertParallelBlock(nn.Module):
    """A sparse MoE block over ``groups.ep_size`` ranks, each holding ``num_experts / ep_size`` experts.

    Parameter names are the HF block's (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``), the
    experts' holding this rank's slice of the experts along dim 0.
    """

    def __init__(self, gate: nn.Module, experts: GroupedExperts, num_experts: int, groups: ExpertGroups,
                 jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_experts = num_experts
        self.groups = groups
        self.jitter_noise = jitter_noise

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``hidden_states`` ``[..., H]`` through the experts its router picks, weighted by the router's scores."""
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's input jitter, as its block applies it
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        tokens = hidden_states.reshape(-1, shape[-1])
        _, weights, picked = self.gate(tokens)
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
        combined = dispatch.decode(returned.view(experts * capacity, -1), rows, weights.t(), tokens.size(0))
        return combined.reshape(shape)

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
