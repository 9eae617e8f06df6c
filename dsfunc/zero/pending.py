"""Values written into parameters built under ``zero.Init``, before ``initialize``, kept sharded until then.

A model built under ``zero.Init`` lives on ``meta`` (:mod:`dsfunc.zero.context`). Libraries initialise
and load such a model before ``initialize`` through ``GatheredParameters(params, modifier_rank=0)``, as
with DeepSpeed (Hugging Face ``from_pretrained`` under ZeRO-3): inside the block each parameter holds
a full tensor on every rank (its value so far, or nan where it has none yet); at the end rank
``modifier_rank``'s values are broadcast and each rank keeps only its ``1/W`` piece (``torch.chunk`` of
the flattened value), and the parameter goes back to ``meta``. So, as with DeepSpeed, no rank ever holds
more than the parameters of one block at once. :func:`dsfunc.init_state` then materialises each owning
module from these pieces (one parameter all-gathered at a time) instead of its ``reset_parameters()``.

The parameter object stays the same (``torch.utils.swap_tensors`` trades its contents with a full
tensor and back), so the module and any tying keep pointing at it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import swap_tensors

from dsfunc.distributed import comm

_KEY = "_dsfunc_pending"  # where a meta parameter keeps its piece (its __dict__)


@dataclasses.dataclass
class Piece:
    """This rank's ``torch.chunk`` piece of a parameter's flattened value."""

    values: torch.Tensor  # 1-d, this rank's chunk (padded: every rank's has the same length)
    numel: int


def comm_device() -> torch.device:
    """Where collectives of the process group run: the current GPU under NCCL, else the host."""
    if comm.is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def has_value(param: torch.Tensor) -> bool:
    """Whether a meta parameter was given a value before ``initialize``."""
    return _KEY in param.__dict__


def full_value(param: torch.Tensor) -> torch.Tensor | None:
    """The value given to meta ``param`` (all-gathered from the pieces: a collective), or None."""
    piece: Piece | None = param.__dict__.get(_KEY)
    if piece is None:
        return None
    out = torch.empty(piece.values.numel() * comm.world_size(), dtype=piece.values.dtype,
                      device=piece.values.device)
    comm.all_gather_flat(out, piece.values)
    return out[: piece.numel].view(param.shape)


class Exposed:
    """Meta parameters holding full tensors for the length of a ``GatheredParameters`` block."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self._meta: list[nn.Parameter] = []

    def expose(self) -> None:
        """Give each parameter a full tensor: its value so far, or nan."""
        device = comm_device()
        for p in self.params:
            value = full_value(p)
            if value is None:
                value = torch.full(p.shape, float("nan"), dtype=p.dtype, device=device)
            full = nn.Parameter(value, requires_grad=p.requires_grad)
            swap_tensors(p, full)  # p is now the full tensor; `full` holds p's meta contents
            p.__dict__.update(full.__dict__)  # p keeps its own attributes
            self._meta.append(full)

    def hide(self, modifier_rank: int | None) -> None:
        """Back to ``meta``; with ``modifier_rank``, that rank's values become each parameter's value."""
        world, rank = comm.world_size(), comm.rank()
        for p, meta in zip(self.params, self._meta):
            piece = None
            if modifier_rank is not None:
                flat = p.detach().reshape(-1).contiguous()
                written = torch.tensor([not bool(flat.isnan().all())], device=flat.device)
                comm.broadcast(written, src=modifier_rank)
                if bool(written):
                    comm.broadcast(flat, src=modifier_rank)
                    chunk = -(-flat.numel() // world)
                    padded = torch.nn.functional.pad(flat, (0, chunk * world - flat.numel()))
                    piece = Piece(padded[rank * chunk:(rank + 1) * chunk].clone(), flat.numel())
            attributes = dict(p.__dict__)
            swap_tensors(p, meta)
            p.__dict__.update(attributes)  # what was set on it inside the block stays
            if piece is not None:
                p.__dict__[_KEY] = piece
        self._meta = []


def forget(param: torch.Tensor) -> None:
    """Drop a parameter's piece (it has been materialised)."""
    param.__dict__.pop(_KEY, None)
