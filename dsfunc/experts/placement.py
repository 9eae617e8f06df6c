"""Where a unit's experts sit in the whole model, so that checkpoints and full weights name them independently of the
expert-parallel degree.

Each expert-parallel rank holds ``L`` of a layer's ``E = P * L`` experts under *local* names. DeepSpeed's ``MoE``
keeps one module per expert: ep rank ``q``'s ``deepspeed_experts.<i>`` is the model's ``deepspeed_experts.<q*L+i>``.
AutoEP's grouped experts stack them in one tensor per projection: each rank's tensor is dim-0 slice ``q`` of the
model's ``[E, ...]`` tensor, under the same name.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dsfunc.distributed import comm
from dsfunc.experts.grouped import GroupedExperts
from dsfunc.experts.local import Experts
from dsfunc.zero.layout import Unit, unit_views

_MODULES = ".deepspeed_experts."  # the infix of an expert's parameter names in DeepSpeed's MoE


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """How a unit's experts are split over the expert-parallel ranks ``ep`` (this rank is ``ep.rank``)."""

    ep: comm.Group
    local: int  # experts per rank
    stacked: bool  # AutoEP: one tensor per projection, split on dim 0; else one module per expert

    def name(self, unit: Unit, name: str, rank: int) -> str:
        """The whole model's name of ep rank ``rank``'s parameter ``name`` of ``unit``."""
        return name if self.stacked else whole_expert_name(name, rank, self.local)


def whole_expert_name(name: str, rank: int, local: int) -> str:
    """The whole model's name of expert-parallel rank ``rank``'s expert parameter ``name``, each rank holding
    ``local`` experts."""
    experts, index, rest = split_expert_name(name)
    return f"{experts}{_MODULES}{rank * local + index}.{rest}"


def split_expert_name(name: str) -> tuple[str, int, str]:
    """``(experts module, expert index, rest)`` of a parameter name of DeepSpeed's ``MoE`` experts
    (``<layer>.deepspeed_moe.experts.deepspeed_experts.<index>.<rest>``); a ValueError for any other name."""
    experts, _, tail = name.partition(_MODULES)
    index, _, rest = tail.partition(".")
    if not (experts and index.isdigit() and rest):
        raise ValueError(f"{name} is not a parameter of an expert of DeepSpeed's MoE")
    return experts, int(index), rest


def is_expert_name(name: str) -> bool:
    """Whether ``name`` is a parameter of one of the experts of DeepSpeed's ``MoE``."""
    return _MODULES in name


def expert_split(model: nn.Module, unit: Unit) -> ExpertSplit | None:
    """``unit``'s split over the expert-parallel ranks (``model``: the program's skeleton), or None when it holds no
    experts."""
    if unit.module is None:
        return None
    module = model.get_submodule(unit.module)
    if not isinstance(module, (Experts, GroupedExperts)):
        return None
    parent = model.get_submodule(unit.module.rpartition(".")[0])
    if isinstance(module, GroupedExperts):  # an ExpertParallelBlock's
        return ExpertSplit(_group(parent.groups.ep), module.num_local, stacked=True)
    return ExpertSplit(_group(parent.ep_group if parent.ep_size > 1 else None), module.num_local_experts,
                       stacked=False)


def _group(process_group: torch.distributed.ProcessGroup | None) -> comm.Group:
    """The expert-parallel ranks (this process alone without a process group)."""
    return comm.Group.lone() if process_group is None else comm.Group.of(process_group)


def whole_values(split: ExpertSplit | None, unit: Unit,
                 flat: torch.Tensor) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """``(names, value)`` of each of ``unit``'s parameters in the whole model, from ``flat`` (this rank's whole
    unit): an expert unit's of every ep rank (a collective over them)."""
    if split is None or split.ep.size == 1:
        return [(slot.aliases, view) for slot, view in zip(unit.params, unit_views(unit, flat))]
    every = torch.empty(split.ep.size * flat.numel(), dtype=flat.dtype, device=flat.device)
    comm.all_gather_flat(every, flat.contiguous(), split.ep)
    views = [unit_views(unit, part) for part in every.chunk(split.ep.size)]
    if split.stacked:
        return [(slot.aliases, torch.cat([v[i] for v in views])) for i, slot in enumerate(unit.params)]
    return [(tuple(split.name(unit, a, r) for a in slot.aliases), view)
            for r, rank_views in enumerate(views) for slot, view in zip(unit.params, rank_views)]
