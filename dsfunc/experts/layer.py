"""DeepSpeed's mixture-of-experts layer: a gate, experts split over the expert-parallel ranks, and optionally
a dense residual expert (Residual MoE, https://arxiv.org/abs/2201.05596).

``MoE(...)(x)`` returns ``(output, l_aux, exp_counts)``; the training loss adds ``l_aux`` (times a coefficient
of the script's choosing). Each rank holds ``num_experts / ep_size`` experts; its tokens are routed with
capacity, exchanged with the other ranks of its expert-parallel group (all-to-all), run through the experts
that own them and sent back. The layer needs its :class:`~dsfunc.experts.groups.ExpertGroups` before a forward
with ``ep_size > 1``: :func:`dsfunc.init_state` (and ``deepspeed.initialize``) bind them
(:func:`bind_experts`). Module and parameter names are DeepSpeed's (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<i>....``), so state dicts carry over.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsfunc.errors import InputError, UsageError
from dsfunc.experts import dispatch
from dsfunc.experts.gate import TopKGate, check
from dsfunc.experts.groups import ExpertGroups, copy_sharing, make_expert_groups
from dsfunc.experts.local import Experts

logger = logging.getLogger("dsfunc")


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (DeepSpeed's ``MOELayer``); ``l_aux`` and ``exp_counts`` of the last
    forward are kept as attributes, as DeepSpeed's are."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: torch.distributed.ProcessGroup | None = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        if use_tutel:
            logger.warning("Tutel optimization requested but not installed. Proceeding without Tutel.")

    def __deepcopy__(self, memo: dict[int, Any]) -> MOELayer:
        return copy_sharing(self, memo, self.ep_group)

    def _set_ep_group(self, ep_group: torch.distributed.ProcessGroup | None) -> None:
        """Exchange tokens (and agree on capacity) over ``ep_group``."""
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def forward(self, *inputs: Tensor) -> Tensor:
        """``inputs[0]`` ``[..., M]`` through the experts; ``inputs[1]`` (optional): top-1's used-token mask."""
        if self.ep_size > 1 and self.ep_group is None:
            raise UsageError(f"this MoE layer splits its experts over ep_size={self.ep_size} ranks but has no "
                             "expert-parallel group yet: build the engine (deepspeed.initialize / dsfunc.init_state) "
                             "before running it, or call its set_deepspeed_parallelism()")
        width = inputs[0].shape[-1]
        tokens = inputs[0].reshape(-1, width)
        routes = self.gate(tokens, inputs[1] if len(inputs) > 1 else None)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        num_experts = self.ep_size * self.num_local_experts
        rows = dispatch.rows_of(routes.experts, routes.locations, num_experts, routes.capacity)
        buffers = dispatch.encode(tokens, rows, num_experts, routes.capacity)
        buffers = dispatch.exchange(buffers, self.ep_group if self.ep_size > 1 else None)
        outputs = self.experts(buffers.reshape(self.ep_size, self.num_local_experts, -1, width))
        outputs = outputs.reshape(num_experts, -1, width)
        outputs = dispatch.exchange(outputs, self.ep_group if self.ep_size > 1 else None)
        combined = dispatch.decode(outputs.view(num_experts * routes.capacity, width), rows, routes.weights,
                                   tokens.size(0))
        return combined.reshape(inputs[0].shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``, with its arguments and defaults.

    Args:
        hidden_size: the width of the layer's input and output.
        expert: the module each expert is a copy of (``[..., hidden_size] -> [..., hidden_size]``).
        num_experts: experts in the layer, over all ranks; ``ep_size`` must divide it.
        ep_size: ranks the experts are split over (it must divide the world size).
        k: experts per token (1 or 2 in DeepSpeed's docs; its code, and this, take up to ``num_experts``).
        capacity_factor / eval_capacity_factor: rows per expert, relative to an even split, in training / eval.
        min_capacity: rows per expert at least.
        use_residual: add a dense copy of ``expert`` mixed in by a learned softmax coefficient.
        noisy_gate_policy: None, ``'Jitter'`` or ``'RSample'`` (training only).
        drop_tokens: drop tokens over capacity (False: capacity is the largest expert count, nothing dropped).
        use_rts: top-1 keeps a random choice of the tokens over capacity rather than the first ones.
        use_tutel: Tutel is not used (DeepSpeed's fallback when it is not installed).
        enable_expert_tensor_parallelism: only with DeepSpeed's tensor-parallel ``mpu``, which dsfunc has not:
            the experts are not split, as in DeepSpeed without one.
        top2_2nd_expert_sampling: top-2 picks its second expert by Gumbel-noisy logits.

    Returns of ``forward(hidden_states, used_token=None)``: ``(output, l_aux, exp_counts)``.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        check(num_experts=num_experts, k=k, noisy_gate_policy=noisy_gate_policy, min_capacity=min_capacity)
        if ep_size < 1 or num_experts % ep_size:
            raise InputError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}: each of the "
                             f"{ep_size} expert-parallel ranks holds num_experts / ep_size experts; pick "
                             "num_experts as a multiple of ep_size")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_groups: ExpertGroups | None = None
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def bind(self, groups: ExpertGroups) -> None:
        """Exchange tokens over ``groups.ep`` and reduce the experts' gradients over ``groups.data``."""
        if groups.ep_size != self.ep_size:
            raise InputError(f"expert groups of ep size {groups.ep_size} given to a layer of ep_size {self.ep_size}")
        self.expert_groups = groups
        self.deepspeed_moe._set_ep_group(groups.ep)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(output, l_aux, exp_counts)`` for ``hidden_states`` ``[..., hidden_size]``."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def bind_experts(model: nn.Module, *, data_first: bool = False) -> dict[str, ExpertGroups]:
    """Give every MoE layer of ``model`` that has none its expert groups (made once per ep size; a collective:
    every rank calls it), and answer which modules hold experts, by path, with their groups: each is a unit of
    its own, its gradients reduced over its expert-data-parallel ranks and, at ZeRO 1-3, its optimizer state,
    gradients (2-3) and parameters (3) sharded over them (:func:`dsfunc.zero.layout.make_plan`)."""
    made: dict[int, ExpertGroups] = {}
    found = {}
    for path, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        if module.expert_groups is None:
            if module.ep_size not in made:
                made[module.ep_size] = make_expert_groups(module.ep_size, data_first=data_first)
            module.bind(made[module.ep_size])
        found[f"{path}.deepspeed_moe.experts" if path else "deepspeed_moe.experts"] = module.expert_groups
    return found
