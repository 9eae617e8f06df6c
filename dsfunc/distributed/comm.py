"""Every collective dsfunc issues, in one place.

Thin wrappers over ``torch.distributed`` that also work without an initialised process group (world
size 1: the collective is the identity), always reduce with SUM (gloo's AVG is unreliable; callers fold
the 1/world factor into the loss), and hide the rename of the flat collectives in torch 2.13
(``all_gather_into_tensor`` -> ``all_gather_single``).

[Note: the data-parallel group] Collectives run over the whole world unless :func:`over` names a group:
a pipeline stage's ZeRO runs over that stage's data-parallel ranks (:mod:`dsfunc.pipeline`), so the
program enters ``over(its group)`` around everything it does (init, step, gathers) and every collective,
``rank()`` and ``world_size()`` here are then the group's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending(Protocol):
    """An in-flight collective: ``wait()`` blocks (the host on gloo, the current stream on NCCL)."""

    def wait(self) -> object: ...


class Done:
    """A collective that already finished (world size 1)."""

    def wait(self) -> bool:
        return True


_GROUP: list[dist.ProcessGroup | None] = [None]  # the group collectives run over (None: the world)


@contextlib.contextmanager
def over(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run the collectives of the enclosed code over ``group`` (None: the world); see [Note: the data-parallel
    group]."""
    outer = _GROUP[0]
    _GROUP[0] = group if group is not None else outer
    try:
        yield
    finally:
        _GROUP[0] = outer


def current_group() -> dist.ProcessGroup | None:
    """The group :func:`over` set (None: the world)."""
    return _GROUP[0]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank(_GROUP[0]) if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size(_GROUP[0]) if is_distributed() else 1


def all_reduce_sum(tensor: torch.Tensor, *, async_op: bool = False) -> Pending:
    """Sum ``tensor`` in place over all ranks."""
    if world_size() == 1:
        return Done()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_GROUP[0], async_op=async_op)
    return work if async_op else Done()


def reduce_scatter_sum(output: torch.Tensor, flat: torch.Tensor, *, async_op: bool = False) -> Pending:
    """``output`` (length S) gets this rank's chunk of the sum over ranks of ``flat`` (length W*S)."""
    if world_size() == 1:
        output.copy_(flat)
        return Done()
    work = _reduce_scatter_flat(output, flat, op=dist.ReduceOp.SUM, group=_GROUP[0], async_op=async_op)
    return work if async_op else Done()


def broadcast(tensor: torch.Tensor, src: int = 0) -> None:
    """Overwrite ``tensor`` in place with rank ``src``'s values (a rank of the :func:`over` group; bool tensors
    travel as bytes: gloo has no bool broadcast)."""
    if world_size() == 1:
        return
    dense = tensor if tensor.is_contiguous() else tensor.contiguous()
    group = _GROUP[0]
    source = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast(dense.view(torch.uint8) if dense.dtype == torch.bool else dense, src=source, group=group)
    if dense is not tensor:
        tensor.copy_(dense)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False) -> Pending:
    """``output`` (length W*S) gets every rank's ``shard`` (length S), concatenated in rank order."""
    if world_size() == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return Done()
    work = _all_gather_flat(output, shard, group=_GROUP[0], async_op=async_op)
    return work if async_op else Done()



def all_to_all(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` gets, in rank order, the ``i``-th equal chunk (along dim 0) of every rank ``i``'s ``tensor``
    over ``group`` (the experts' token exchange, :mod:`dsfunc.experts.dispatch`)."""
    dist.all_to_all_single(output, tensor, group=group)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Replace ``tensor`` in place by its elementwise maximum over ``group`` (integer counts: exact)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
