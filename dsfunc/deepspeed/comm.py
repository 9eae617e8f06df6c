"""``deepspeed.comm``: torch.distributed's everyday calls as DeepSpeed scripts make them (``from deepspeed import
comm as dist``), over the process group dsfunc joins.

The calls are torch.distributed's, with two differences that make a script run alone: in a process
that joined no group, ``get_rank()`` is 0, ``get_world_size()`` is 1 and the collectives leave their
tensors as they are (DeepSpeed asserts there). dsfunc's own collectives are :mod:`dsfunc.distributed.comm`;
this module is the script-facing surface only.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dsfunc.distributed import comm as _comm
from dsfunc.distributed import init_distributed
from dsfunc.errors import unsupported

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier", "broadcast",
    "destroy_process_group", "gather", "get_backend", "get_global_rank", "get_local_rank", "get_rank",
    "get_world_group", "get_world_size", "inference_all_reduce", "init_distributed", "irecv", "is_available",
    "is_initialized", "isend",
    "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter_tensor", "scatter", "send",
]


def is_initialized() -> bool:
    return _comm.is_distributed()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if is_initialized() and group is not None else group_rank


def get_world_group() -> Any:
    return dist.group.WORLD


def get_backend(group: Any = None) -> str | None:
    return dist.get_backend(group) if is_initialized() else None


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs) if is_initialized() else None


def destroy_process_group(group: Any = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    if is_initialized():
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    return None


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
    if is_initialized():
        return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    return None


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op) if is_initialized() else None


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> Any:
    """DeepSpeed's all-reduce for inference (its own kernel on some devices): here :func:`all_reduce`."""
    return all_reduce(tensor, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op) if is_initialized() else None


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op) if is_initialized() else None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    if is_initialized():
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, tensor, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return scatter(output_tensor, tensor, op=op, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)
    output.copy_(tensor)
    return None


def gather(tensor: torch.Tensor, gather_list: Any = None, dst: int = 0, group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)
    if gather_list:
        gather_list[0].copy_(tensor)
    return None


def scatter(tensor: torch.Tensor, scatter_list: Any = None, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)
    if scatter_list:
        tensor.copy_(scatter_list[0])
    return None


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's communication-logger summary: nothing to print (dsfunc has no comms logger)."""


def __getattr__(name: str) -> Any:
    """Any other public name of DeepSpeed's comm module imports, and raises when called."""
    if name.startswith("_"):
        raise AttributeError(name)
    return unsupported(f"deepspeed.comm.{name}", "a communication call dsfunc does not provide",
                       "use torch.distributed directly")
