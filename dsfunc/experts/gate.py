"""The router: a bias-free linear layer in fp32 scoring each token for each expert, then a top-k routing."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dsfunc.errors import InputError
from dsfunc.experts import routing
from dsfunc.experts.groups import copy_sharing
from dsfunc.experts.routing import Routes

NOISE_POLICIES = (None, "None", "Jitter", "RSample")


class TopKGate(nn.Module):
    """Scores tokens with ``wg`` and routes each to ``k`` experts (DeepSpeed's ``TopKGate``).

    Training routes with ``capacity_factor`` and the noise policy (``Jitter``: the input scaled by uniform noise
    in [0.99, 1.01]; ``RSample``: top-1 picks by Gumbel-noisy logits); evaluation with ``eval_capacity_factor``
    and no noise. ``ep_group`` is where the capacity without dropping is agreed on (bound later by the layer).
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True,
                 ep_group: torch.distributed.ProcessGroup | None = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        check(num_experts=num_experts, k=k, noisy_gate_policy=noisy_gate_policy, min_capacity=min_capacity)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def __deepcopy__(self, memo: dict[int, Any]) -> TopKGate:
        return copy_sharing(self, memo, self.ep_group)

    def forward(self, tokens: Tensor, used_token: Tensor | None = None) -> Routes:
        """The routes of ``tokens`` ``[S, M]`` (``used_token``: a 0/1 mask of the tokens to route, top-1 only)."""
        scored = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            scored = scored * routing.uniform(scored.shape, tokens.device, 1.0 - 1e-2, 1.0 + 1e-2)
        logits = nn.functional.linear(scored, weight=self.wg.weight.float(), bias=None)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return routing.top1(logits, factor, self.min_capacity, used_token=used_token,
                                rsample=self.training and self.noisy_gate_policy == "RSample",
                                drop_tokens=self.drop_tokens, use_rts=self.use_rts, ep_group=self.ep_group)
        if used_token is not None:
            raise InputError("used_token masks tokens for top-1 gating only (k=1), as in DeepSpeed; this gate has "
                             f"k={self.k}")
        if self.k == 2:
            return routing.top2(logits, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                                ep_group=self.ep_group, sample_second=self.top2_2nd_expert_sampling)
        return routing.topk(logits, self.k, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                            ep_group=self.ep_group)


def check(*, num_experts: int, k: int, noisy_gate_policy: str | None, min_capacity: int) -> None:
    """Reject a gate configuration DeepSpeed would reject or fail on, naming the fix."""
    if num_experts < 1:
        raise InputError(f"num_experts must be at least 1, got {num_experts}")
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise InputError(f"k={k!r}: each token goes to k of the {num_experts} experts, so k must be an integer "
                         f"from 1 to {num_experts} (DeepSpeed's MoE is made for k=1 or k=2)")
    if noisy_gate_policy not in NOISE_POLICIES:
        raise InputError(f"noisy_gate_policy={noisy_gate_policy!r} is not one of DeepSpeed's: None, 'None', "
                         "'Jitter' or 'RSample'")
    if min_capacity < 0:
        raise InputError(f"min_capacity must be at least 0, got {min_capacity}")
