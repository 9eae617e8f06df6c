"""Parameters made under ``zero.Init``: an empty placeholder on the device, the value kept sharded until
``initialize``.

As with DeepSpeed, a parameter built under ``zero.Init`` keeps the value its module's construction gave it,
but no rank holds it whole: rank 0's value is broadcast and each rank keeps its ``1/W`` piece
(``torch.chunk`` of the flattened value, padded at the tail) as ``ds_tensor``; the parameter itself becomes an
empty tensor on the device the collectives run on, with DeepSpeed's attributes (``ds_id``, ``ds_shape``,
``ds_numel``, ``ds_status``). So code that reads a parameter's device or dtype (Hugging Face picks its kernels
by them) sees a real one, and code that reads ``ds_shape`` sees the full shape.

Libraries initialise and load such a model before ``initialize`` through ``GatheredParameters(params,
modifier_rank=0)`` (Hugging Face ``from_pretrained`` under ZeRO-3): inside the block each parameter holds
its full value on every rank (:class:`Exposed`); at the end rank ``modifier_rank``'s values are broadcast and
each rank keeps its new piece. :func:`dsfunc.init_state` then builds the masters from these pieces (one
parameter all-gathered at a time), so no rank ever holds more than one parameter of the model at once.
The parameter object stays the same throughout (only its ``.data`` changes), so modules and tying keep
pointing at it.
"""

from __future__ import annotations

import enum
import itertools

import torch
import torch.distributed as dist
from torch import nn

from dsfunc.distributed import comm

_DS_IDS = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ds_status`` of a ZeRO-3 parameter: whether its data is the full tensor right now."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def next_ds_id() -> int:
    """A fresh ``ds_id`` (DeepSpeed's parameter id: unique in the process, in the order parameters get one)."""
    return next(_DS_IDS)


def comm_device() -> torch.device:
    """Where collectives of the process group run: the current GPU under NCCL, else the host."""
    if comm.is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_placeholder(param: torch.Tensor) -> bool:
    """Whether ``param`` was made under ``zero.Init`` and its value still lives in pieces (until
    ``initialize`` takes it)."""
    return "ds_tensor" in param.__dict__ and "ds_shape" in param.__dict__


@torch.no_grad()
def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of ``param``'s value: its own, or a placeholder's ``ds_shape``."""
    return param.ds_shape if is_placeholder(param) else param.shape


@torch.no_grad()
def partition(param: nn.Parameter) -> None:
    """Make ``param`` a placeholder: rank 0's value, kept in pieces over the ranks (a collective: every rank
    partitions the same parameters in the same order). A parameter on ``meta`` has no value to keep and is
    left as it is (``initialize`` materialises it with its module's ``reset_parameters()``)."""
    if param.is_meta or is_placeholder(param):
        return
    device = comm_device()
    flat = param.detach().reshape(-1).to(device, copy=True)
    comm.broadcast(flat, comm.Group.world())  # zero.Init partitions over the world, as DeepSpeed's does
    param.ds_tensor = _piece(flat)
    if "ds_id" not in param.__dict__:
        param.ds_id = next_ds_id()
    param.ds_shape, param.ds_numel = param.shape, param.numel()
    _empty(param, device)


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The value of placeholder ``param`` (all-gathered from the pieces: a collective), full shape."""
    piece: torch.Tensor = param.ds_tensor
    out = torch.empty(piece.numel() * comm.world_size(), dtype=piece.dtype, device=piece.device)
    comm.all_gather_flat(out, piece, comm.Group.world())
    return out[: param.ds_numel].view(param.ds_shape)


def forget(param: torch.Tensor) -> None:
    """Drop a placeholder's pieces (``initialize`` has built its masters from them); ``ds_id`` stays."""
    for key in ("ds_tensor", "ds_status"):
        param.__dict__.pop(key, None)


def _piece(flat: torch.Tensor) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``flat``, padded so that every rank's has the same length."""
    world, rank = comm.world_size(), comm.rank()
    chunk = -(-flat.numel() // world)
    padded = torch.nn.functional.pad(flat, (0, chunk * world - flat.numel()))
    return padded[rank * chunk : (rank + 1) * chunk].clone()


def _empty(param: nn.Parameter, device: torch.device) -> None:
    param.data = torch.empty(0, dtype=param.dtype, device=device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


class Exposed:
    """Placeholders holding their full values for the length of a ``GatheredParameters`` block."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params

    def expose(self) -> None:
        """Give each parameter its full value (every rank)."""
        for p in self.params:
            p.data = full_value(p).to(p.dtype, copy=True)
            p.ds_status = ZeroParamStatus.AVAILABLE

    @torch.no_grad()
    def hide(self, modifier_rank: int | None) -> None:
        """Back to empty; with ``modifier_rank``, that rank's values become each parameter's value."""
        for p in self.params:
            device = p.ds_tensor.device
            if modifier_rank is not None:
                flat = p.detach().reshape(-1).to(device=device, dtype=p.ds_tensor.dtype, copy=True)
                comm.broadcast(flat, comm.Group.world(), src=modifier_rank)
                p.ds_tensor.copy_(_piece(flat))
            _empty(p, device)
