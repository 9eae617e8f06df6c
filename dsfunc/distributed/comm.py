"""Every collective dsfunc issues, in one place.

Thin wrappers over ``torch.distributed`` that also work without an initialised process group (world
size 1: the collective is the identity), always reduce with SUM (gloo's AVG is unreliable; callers fold
the 1/world factor into the loss), and hide the rename of the flat collectives in torch 2.13
(``all_gather_into_tensor`` -> ``all_gather_single``).

[Note: groups are passed explicitly] Every collective names the :class:`Group` it runs over: ZeRO's
(a unit is sharded and reduced over the mesh's dp x sp ranks, :mod:`dsfunc.distributed.mesh`), a pipeline's,
a tied module's or the tensor-parallel ranks'. The plan and the program carry them; ``rank()`` and
``world_size()`` here always answer for the whole world.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.distributed as dist

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class InFlight(Protocol):
    """An in-flight collective: ``wait()`` blocks (the host on gloo, the current stream on NCCL)."""

    def wait(self) -> object: ...


class Done:
    """A collective that already finished (world size 1)."""

    def wait(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """Which ranks a collective runs over: their global ranks in group order, this process's index among them,
    and torch's group (None: the default group, or no process group at all when there is one rank)."""

    ranks: tuple[int, ...]
    rank: int
    process_group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def lone(cls) -> Group:
        """This process alone (no collective runs)."""
        return cls((rank(),), 0, None)

    @classmethod
    def world(cls) -> Group:
        """Every rank of the default group (this process alone when there is none)."""
        return cls(tuple(range(world_size())), rank(), None)

    @classmethod
    def of(cls, process_group: dist.ProcessGroup | None) -> Group:
        """The group torch's ``process_group`` is (None: the world); this process must be one of its ranks."""
        if process_group is None or not is_distributed():
            return cls.world()
        return cls(tuple(dist.get_process_group_ranks(process_group)), dist.get_rank(process_group), process_group)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the world."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks in the world."""
    return dist.get_world_size() if is_distributed() else 1


def all_reduce_sum(tensor: torch.Tensor, group: Group, *, async_op: bool = False) -> InFlight:
    """Sum ``tensor`` in place over ``group``."""
    if group.size == 1:
        return Done()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.process_group, async_op=async_op)
    return work if async_op else Done()


def reduce_scatter_sum(output: torch.Tensor, flat: torch.Tensor, group: Group, *,
                       async_op: bool = False) -> InFlight:
    """``output`` (length S) gets this rank's chunk of the sum over ``group`` of ``flat`` (length W*S)."""
    if group.size == 1:
        output.copy_(flat)
        return Done()
    work = _reduce_scatter_flat(output, flat, op=dist.ReduceOp.SUM, group=group.process_group, async_op=async_op)
    return work if async_op else Done()


def broadcast(tensor: torch.Tensor, group: Group, src: int = 0) -> None:
    """Overwrite ``tensor`` in place with the values of ``group``'s rank ``src`` (bool tensors travel as bytes:
    gloo has no bool broadcast)."""
    if group.size == 1:
        return
    dense = tensor if tensor.is_contiguous() else tensor.contiguous()
    dist.broadcast(dense.view(torch.uint8) if dense.dtype == torch.bool else dense, src=group.ranks[src],
                   group=group.process_group)
    if dense is not tensor:
        tensor.copy_(dense)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: Group, *, async_op: bool = False) -> InFlight:
    """``output`` (length W*S) gets the ``shard`` (length S) of every rank of ``group``, in group order."""
    if group.size == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return Done()
    work = _all_gather_flat(output, shard, group=group.process_group, async_op=async_op)
    return work if async_op else Done()



def all_to_all(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` gets, in rank order, the ``i``-th equal chunk (along dim 0) of every rank ``i``'s ``tensor``
    over ``group`` (the experts' token exchange, :mod:`dsfunc.experts.dispatch`)."""
    dist.all_to_all_single(output, tensor, group=group)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Replace ``tensor`` in place by its elementwise maximum over ``group`` (integer counts: exact)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
