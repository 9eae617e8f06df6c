"""The process groups of expert parallelism: experts split over ``ep`` ranks, each expert replicated over the
rest (its expert-data-parallel ranks).

DeepSpeed's arrangement (``deepspeed.utils.groups``, "E + D"): with W ranks and ep size P, the expert-parallel groups
are the blocks of P neighbouring ranks ``[i*P, (i+1)*P)`` (the all-to-all runs in them) and the
expert-data-parallel groups are the strided ranks ``{j, j+P, j+2P, ...}`` (an expert's gradients are reduced
over them, its initial weights broadcast from the first of them). ``data_first`` ("D + E",
``use_data_before_expert_parallel_``) swaps the two patterns. Non-expert parameters stay on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch.distributed as dist

from dsfunc.distributed import comm
from dsfunc.errors import InputError


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertGroups:
    """This rank's groups for one ep size: where its experts' tokens are exchanged (``ep``) and where their
    gradients are reduced (``data``), each a process group of its own even of one rank; None without a
    process group (one process)."""

    ep_size: int
    ep_ranks: tuple[int, ...]
    data_ranks: tuple[int, ...]
    ep: dist.ProcessGroup | None
    data: dist.ProcessGroup | None

    @property
    def name(self) -> str:
        """DeepSpeed's name for these groups (``ep_size_<P>``), which expert parameters carry."""
        return f"ep_size_{self.ep_size}"

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertGroups:
        """Process groups are handles to the run's communicators: a copied model shares them."""
        return self


def group_ranks(world: int, ep_size: int, *, data_first: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """Every expert-parallel group and every expert-data-parallel group of a world, as rank lists."""
    if ep_size < 1:
        raise InputError(f"ep_size must be at least 1, got {ep_size}")
    if world % ep_size:
        raise InputError(f"the expert-parallel size {ep_size} does not divide the world size {world}: launch a "
                         f"multiple of {ep_size} ranks or choose an ep_size that divides {world}")
    stride = world // ep_size
    if data_first:
        data = [list(range(i * stride, (i + 1) * stride)) for i in range(ep_size)]
        experts = [list(range(i, world, stride)) for i in range(stride)]
    else:
        data = [list(range(i, world, ep_size)) for i in range(ep_size)]
        experts = [list(range(i * ep_size, (i + 1) * ep_size)) for i in range(stride)]
    return experts, data


def make_expert_groups(ep_size: int, *, data_first: bool = False) -> ExpertGroups:
    """This rank's :class:`ExpertGroups` for ``ep_size`` (a collective: every rank calls it, in the same order)."""
    world, rank = comm.world_size(), comm.rank()
    experts, data = group_ranks(world, ep_size, data_first=data_first)
    mine: dict[str, Any] = {}
    for kind, lists in (("data", data), ("ep", experts)):  # DeepSpeed's creation order
        for ranks in lists:
            group = dist.new_group(ranks) if comm.is_distributed() else None
            if rank in ranks:
                mine[kind], mine[f"{kind}_ranks"] = group, tuple(ranks)
    return ExpertGroups(ep_size, mine["ep_ranks"], mine["data_ranks"], mine["ep"], mine["data"])


def copy_sharing(obj: Any, memo: dict[int, Any], *handles: Any) -> Any:
    """A deep copy of ``obj`` (a module holding process groups) that shares ``handles``: a process group is a
    handle to the run's communicators, which cannot be copied (a copied model, e.g. dsfunc's skeleton, keeps them)."""
    for handle in handles:
        if handle is not None:
            memo[id(handle)] = handle
    new = obj.__class__.__new__(obj.__class__)
    memo[id(obj)] = new
    new.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    return new
