"""DeepSeek's MoE blocks (V2 and V3) under AutoEP: the routed experts split over the expert-parallel ranks, as in
every :class:`~dsfunc.experts.ep_block.ExpertParallelBlock`, plus the block's shared experts, which every token passes
through: a dense MLP held whole on every rank, its gradients reduced over all of them like any dense parameter.
"""

from __future__ import annotations

from torch import Tensor, nn

from dsfunc.experts.ep_block import ExpertParallelBlock


class SharedExpertParallelBlock(ExpertParallelBlock):
    """An expert-parallel block whose output adds its ``shared_experts`` (the HF block's module, kept as it is)."""

    def __init__(self, routed: ExpertParallelBlock, shared_experts: nn.Module) -> None:
        super().__init__(routed.gate, routed.experts, routed.num_experts, routed.groups, routed.jitter_noise)
        self.shared_experts = shared_experts

    def forward(self, hidden_states: Tensor) -> Tensor:
        """The routed experts' output for ``hidden_states`` ``[..., H]`` plus the shared experts', as HF's block."""
        return super().forward(hidden_states) + self.shared_experts(hidden_states)
