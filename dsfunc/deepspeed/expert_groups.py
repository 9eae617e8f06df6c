"""``deepspeed.utils.groups``: DeepSpeed's registry of expert-parallel process groups, by name (``ep_size_<P>``).

DeepSpeed keeps the groups a run made in module globals and scripts query them by name; this module is that
registry for dsfunc's MoE layers (:mod:`dsfunc.experts`), filled when an engine is built or a layer's
``set_deepspeed_parallelism()`` runs. Without tensor or pipeline parallelism through DeepSpeed's ``mpu`` (which
dsfunc does not take), the data-parallel group is the world, as in DeepSpeed without one.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dsfunc.deepspeed.namespace import other_name
from dsfunc.distributed import comm
from dsfunc.errors import NotSupportedError, UsageError
from dsfunc.experts.groups import ExpertGroups, make_expert_groups

mpu = None  # DeepSpeed's model-parallel unit: Ulysses' groups, set by initialize(mpu=...) as DeepSpeed sets it
_MADE: dict[str, ExpertGroups] = {}


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: Any = None, pp_size: Any = None,
                                     mp_mode: str = "tp", use_data_before_expert_parallel_: bool = False,
                                     folding_spec: Any = None) -> None:
    """Make the groups of ep size ``expert_parallel_size_`` once (a collective: every rank calls it)."""
    if (mp_size or 1) > 1 or (pp_size or 1) > 1 or folding_spec is not None:
        raise NotSupportedError("expert groups folded with tensor, sequence or pipeline parallelism "
                                "(mp_size / pp_size / folding_spec) are not supported by dsfunc yet")
    name = f"ep_size_{expert_parallel_size_}"
    if name not in _MADE:
        _MADE[name] = make_expert_groups(expert_parallel_size_, data_first=use_data_before_expert_parallel_)


def groups_of(ep_size: int, *, data_first: bool = False) -> ExpertGroups:
    """The registry's groups of ``ep_size``, made if new."""
    _create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel_=data_first)
    return _MADE[f"ep_size_{ep_size}"]


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's ``groups.initialize``: make the expert groups of ``ep_size``."""
    if mpu is not None:
        raise NotSupportedError("groups.initialize(mpu=...): dsfunc takes no DeepSpeed model-parallel unit")
    _create_expert_and_data_parallel(ep_size)


def _made(group_name: str) -> ExpertGroups:
    if group_name not in _MADE:
        raise UsageError(f"expert parallel group {group_name!r} is not initialized (made: {sorted(_MADE)}): build "
                         "the engine first (deepspeed.initialize makes the groups of the model's MoE layers)")
    return _MADE[group_name]


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    return _made(group_name).ep


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    return _made(group_name).data


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_made(group_name).ep_ranks)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_made(group_name).data_ranks)


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup | None]:
    return {name: g.ep for name, g in _MADE.items()}


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup | None]:
    return {name: g.data for name, g in _MADE.items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return len(_made(group_name).ep_ranks)


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return len(_made(group_name).data_ranks)


def _get_expert_parallel_rank(group_name: str) -> int:
    return _made(group_name).ep_ranks.index(comm.rank())


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _made(group_name).data_ranks.index(comm.rank())


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-parallel group."""
    return _made(group_name).ep_ranks[0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank an expert's initial weights come from: the first of its expert-data-parallel group."""
    return _made(group_name).data_ranks[0]


def _get_max_expert_size() -> int | None:
    """The largest ep size made (None before any)."""
    return max((g.ep_size for g in _MADE.values()), default=None)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> dist.ProcessGroup | None:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    """The sp group of the ``mpu`` initialize was given (Hugging Face's Ulysses loss reduces over it)."""
    if mpu is None:
        raise KeyError("No sequence parallel group found")  # DeepSpeed's error, without an mpu or a mesh
    return mpu.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return 1 if mpu is None else mpu.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    return 0 if mpu is None else mpu.get_sequence_parallel_rank()


def _get_data_parallel_group() -> dist.ProcessGroup:
    return dist.group.WORLD


def _get_data_parallel_group_ranks() -> list[int]:
    return list(range(comm.world_size()))


def _get_data_parallel_world_size() -> int:
    return comm.world_size()


def _get_data_parallel_rank() -> int:
    return comm.rank()


def _get_broadcast_src_rank() -> int:
    return 0


def __getattr__(name: str) -> Any:
    return other_name("utils.groups", name)
