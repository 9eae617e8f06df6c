"""Tensor parallelism over the mesh's tp axis, with torch's own ``torch.distributed.tensor.parallel``.

:func:`tensor_parallel` applies a tp plan (:mod:`dsfunc.parallel.autotp`) to the skeleton with
``parallelize_module``: each split module gets torch's input/output hooks (the all-reduces and gathers between
the tp ranks) and DTensor parameters. ZeRO then holds each rank's *TP-local* parameters: the DTensors are
replaced by their local tensors (so units, flat buffers, binding and the reducer see ordinary tensors, and shard
them over ``dp x sp``), and a hook around each split module's forward views the bound local tensors as the
DTensors torch's styles expect (``DTensor.from_local``, differentiable: the local gradients flow back into the
unit's flat buffer). Parameters no style splits are replicated over tp and get the same gradient on every tp
rank, so they are reduced over ``dp`` only; norms count each of their values once (:mod:`dsfunc.zero.norms`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.parallel import parallelize_module

from dsfunc.config import TensorParallelConfig
from dsfunc.distributed import comm
from dsfunc.distributed.mesh import Mesh
from dsfunc.errors import InputError, NotSupportedError
from dsfunc.parallel.autotp import Plan, resolve_plan


@dataclasses.dataclass(frozen=True)
class SplitParam:
    """How one parameter is split over tp: its placements and its global shape and stride."""

    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class TensorParallel:
    """The tp half of a program: the split parameters (by name) and the tp ranks they are split over."""

    group: comm.Group
    device_mesh: DeviceMesh
    split: Mapping[str, SplitParam]

    def local_value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``name`` from its full ``value`` (tp rank 0's, broadcast: ranks that did
        not seed alike still train one model); a value already local (a module trained in place) is returned."""
        spec = self.split.get(name)
        if spec is not None and tuple(value.shape) != tuple(spec.shape):
            return value
        value = value.detach().clone()
        comm.broadcast(value, self.group)
        return self.local_part(name, value)

    def local_part(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``name``'s whole ``value`` (a view; no collective)."""
        spec = self.split.get(name)
        for placement in spec.placements if spec is not None else ():
            if isinstance(placement, Shard):
                value = value.chunk(self.group.size, placement.dim)[self.group.rank]
        return value

    def full_value(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s whole value from every tp rank's ``local`` part (a collective over tp)."""
        spec = self.split.get(name)
        if spec is None:
            return local
        dense = local.detach().contiguous()
        parts = torch.empty(self.group.size * dense.numel(), dtype=dense.dtype, device=dense.device)
        comm.all_gather_flat(parts, dense.reshape(-1), self.group)
        dim = next(p.dim for p in spec.placements if isinstance(p, Shard))
        return torch.cat(parts.view(self.group.size, *dense.shape).unbind(0), dim=dim)

    def sync(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make ``tensors`` (buffers, frozen parameters) tp rank 0's on every tp rank."""
        for t in tensors.values():
            comm.broadcast(t, self.group)


def tensor_parallel(skeleton: nn.Module, mesh: Mesh, section: TensorParallelConfig,
                    given: Plan | None) -> TensorParallel | None:
    """Split ``skeleton``'s modules over the mesh's tp axis (in place); None when tp is 1."""
    tp = mesh.size("tp")
    if tp == 1:
        if given is not None:
            raise InputError("init_state(tp_plan=...) needs a tp axis: set tensor_parallel.autotp_size (or give a "
                             "mesh with a tp dimension)")
        return None
    plan = resolve_plan(skeleton, section, given)
    _check_heads(skeleton, tp)
    device_mesh = mesh["tp"]
    parallelize_module(skeleton, device_mesh, plan)
    split: dict[str, SplitParam] = {}
    for path, module in skeleton.named_modules():
        specs = {}  # this module's DTensor parameters (a row-parallel bias is one too, replicated)
        for attr, p in list(module._parameters.items()):
            if not isinstance(p, DTensor):
                continue
            name = f"{path}.{attr}" if path else attr
            for placement in p.placements:
                if isinstance(placement, Shard) and p.shape[placement.dim] % tp:
                    raise InputError(f"{name} has {p.shape[placement.dim]} rows along dim {placement.dim}, not "
                                     f"divisible by the {tp} tensor-parallel ranks: choose an autotp_size that "
                                     "divides it, or leave the module out of the tp plan")
            specs[attr] = SplitParam(tuple(p.placements), p.shape, tuple(p.stride()))
            if any(isinstance(pl, Shard) for pl in p.placements):
                split[name] = specs[attr]
            module._parameters[attr] = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
        if specs:
            _view_as_dtensors(module, device_mesh, specs)
    return TensorParallel(mesh.group("tp"), device_mesh, split)


def check_tensor_parallel(model: nn.Module) -> None:
    """What tensor parallelism does not compose with yet, refused by name."""
    if any(p.is_meta or "ds_tensor" in p.__dict__ for p in model.parameters()):
        raise NotSupportedError("tensor parallelism over a model on the meta device or built under zero.Init is not "
                                "supported by dsfunc yet: build the model with its values (or at tp 1)")


def _view_as_dtensors(module: nn.Module, device_mesh: DeviceMesh, specs: Mapping[str, SplitParam]) -> None:
    """Around ``module``'s forward, its bound local parameters are seen as the DTensors torch's style expects."""
    held: dict[str, Any] = {}
    module.__dict__["_dsfunc_tp"] = (device_mesh, specs)  # read by code that uses the weights, not the forward

    def before(mod: nn.Module, args: Any) -> None:
        for attr, spec in specs.items():
            local = mod._parameters[attr]
            held[attr] = local
            mod._parameters[attr] = DTensor.from_local(local, device_mesh, spec.placements, run_check=False,
                                                       shape=spec.shape, stride=spec.stride)

    def after(mod: nn.Module, args: Any, output: Any) -> None:
        for attr in specs:
            mod._parameters[attr] = held.pop(attr)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)


def _check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads and KV heads must split whole over tp (a tp rank runs its own heads): as the model's
    ``config`` says them, or a submodule's (a pipeline stage's layers), or a module's own attributes."""
    holders: dict[int, tuple[str, Any]] = {}
    for path, module in model.named_modules():
        for where, holder in ((f"{path or 'model'}.config", getattr(module, "config", None)), (path or "model", module)):
            if holder is not None:
                holders.setdefault(id(holder), (where, holder))
    for where, holder in holders.values():
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(holder, key, None)
            if isinstance(heads, int) and heads % tp:
                raise InputError(f"{where}.{key} ({heads}) is not divisible by the {tp} tensor-parallel ranks "
                                 "(tensor_parallel.autotp_size): each tp rank needs whole heads; choose an autotp_size "
                                 f"that divides {heads}")
