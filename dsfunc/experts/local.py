"""The experts a rank holds: copies of one expert module, each run on its block of the dispatched tokens."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert`` (same initial weights, as DeepSpeed's deep copies).

    Their parameters carry DeepSpeed's marks of an expert's (``allreduce = False``, ``group_name``), which
    ``deepspeed.moe.utils.is_moe_param`` and the optimizer-group helpers read.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs`` ``[ranks, local experts, C, M]``: expert ``i`` runs on ``inputs[:, i]`` (every expert runs,
        see [Note: every expert runs] in :mod:`dsfunc.experts.dispatch`)."""
        outputs = []
        for block, module in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = module(block)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: the output
        return torch.cat(outputs, dim=1)
