"""Mixture of experts: DeepSpeed's MoE layer, its top-k gates and expert parallelism (DESIGN.md §4b)."""

from dsfunc.experts.gate import TopKGate
from dsfunc.experts.groups import ExpertGroups, make_expert_groups
from dsfunc.experts.layer import MoE, MOELayer, bind_experts
from dsfunc.experts.local import Experts
from dsfunc.experts.routing import Routes

__all__ = [
           "ExpertGroups",
           "Experts",
           "MOELayer",
           "MoE",
           "Routes",
           "TopKGate",
           "bind_experts",
           "make_expert_groups",
]
