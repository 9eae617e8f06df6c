"""Materialising the fp32 masters: from the user's module, from ``zero.Init``'s pieces, or from ``meta`` one
module at a time.

A materialised model starts from rank 0's values, as DeepSpeed's engine does: each unit's flat buffer,
and every buffer and frozen parameter, is broadcast from rank 0 before each rank keeps its shard, so a
script that does not seed its ranks alike still trains one model. A model built under ``zero.Init`` or on
the ``meta`` device never exists in full on any rank: each rank all-gathers one parameter at a time from
the pieces ``zero.Init`` kept of rank 0's values (:mod:`dsfunc.zero.placeholders`), or materialises one
owning module at a time (``reset_parameters()`` or the user's ``param_init_fn``, seeded per module so
every rank draws the same values), flattens each unit and keeps only its own shard; those values are
alike on every rank already, so nothing needs broadcasting.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dsfunc.distributed import comm
from dsfunc.errors import InputError
from dsfunc.zero import placeholders
from dsfunc.zero.layout import ShardingPlan, flatten_unit, local_shard
from dsfunc.zero.offload import HostOffload


@dataclasses.dataclass
class InitStats:
    """How many parameter elements existed at once while materialising from ``meta``."""

    max_elements: int = 0


INIT_STATS = InitStats()


@torch.no_grad()
def materialize(
    model: nn.Module, skeleton: nn.Module, plan: ShardingPlan, device: torch.device, seed: int,
    param_init_fn: Callable[[nn.Module], None] | None, host: HostOffload | None = None,
    local: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's fp32 master shards (by unit) and its buffers (and frozen parameters) by name.

    The masters are made on ``device`` (the broadcast from rank 0 runs there) and kept there, or in host
    memory when ``host`` offloads them: this is where the state's masters, and so its optimizer state
    (initialised like them), are placed. ``local(name, value)``: this rank's part of a parameter's value (its tp
    part, :mod:`dsfunc.parallel.tensor`).
    """
    on_meta = any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())
    source = _MetaSource(skeleton, device, seed, param_init_fn) if on_meta else None
    tensors = dict(model.named_parameters(remove_duplicate=False))
    params = {}
    for unit in plan.units:
        values, alike = _values(tensors, [slot.name for slot in unit.params], source)
        if local is not None:
            values = {k: local(k, v) for k, v in values.items()}
        values = {k: v.to(device=device, dtype=torch.float32) for k, v in values.items()}
        flat = flatten_unit(unit, values, plan.padded_size(unit))
        if not alike:
            comm.broadcast(flat, plan.group)
        INIT_STATS.max_elements = max(INIT_STATS.max_elements, flat.numel())
        shard = flat if plan.ways == 1 else local_shard(plan, unit, flat)
        params[unit.name] = shard if host is None else host.to_host(shard)
        del flat, values, shard
    extra = dict(model.named_buffers())
    extra.update({name: tensors[name] for name in plan.frozen})
    values, alike = _values(extra, list(extra), source)
    buffers = {k: v.detach().to(device).clone() for k, v in values.items()}
    for p in model.parameters():  # a module may be materialised for several units: forget only now
        placeholders.forget(p)
    if not alike:
        for t in buffers.values():
            comm.broadcast(t, plan.group)
    return params, buffers


def _values(tensors: dict[str, torch.Tensor], names: list[str],
            source: _MetaSource | None) -> tuple[dict[str, torch.Tensor], bool]:
    """The values of ``names``, and whether they are alike on every rank already (made from ``zero.Init``'s
    pieces or from ``meta``): a placeholder's from its pieces, a ``meta`` tensor's by ``source``, any other's
    its own."""
    out, on_meta = {}, []
    for name in names:
        t = tensors[name]
        if placeholders.is_placeholder(t):
            out[name] = placeholders.full_value(t)
        elif t.is_meta:
            on_meta.append(name)
        else:
            out[name] = t.detach()
    if on_meta:
        out.update(source.unit_tensors(on_meta))
    alike = len(out) == len(on_meta) + sum(placeholders.is_placeholder(tensors[n]) for n in names)
    return {n: out[n] for n in names}, alike


class _MetaSource:
    """Materialises parameters of a ``meta`` model one owning module at a time, identically on every rank."""

    def __init__(self, skeleton: nn.Module, device: torch.device, seed: int,
                 init_fn: Callable[[nn.Module], None] | None) -> None:
        self.skeleton, self.device, self.seed, self.init_fn = skeleton, device, seed, init_fn
        self.order = {name: i for i, (name, _) in enumerate(skeleton.named_modules())}

    def unit_tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        by_module: dict[str, list[str]] = {}
        for name in names:
            path, _, attr = name.rpartition(".")
            by_module.setdefault(path, []).append(attr)
        out = {}
        for path, attrs in by_module.items():
            made = self._materialize_module(path)
            for attr in attrs:
                out[f"{path}.{attr}" if path else attr] = made[attr]
        return out

    def _materialize_module(self, path: str) -> dict[str, torch.Tensor]:
        module = self.skeleton.get_submodule(path) if path else self.skeleton
        alone = copy.copy(module)  # shallow: own parameters and buffers only, no children
        alone._modules = {}
        alone._parameters = {k: nn.Parameter(torch.empty_like(v, device=self.device), v.requires_grad)
                             for k, v in module._parameters.items() if v is not None}
        alone._buffers = {k: torch.empty_like(v, device=self.device)
                          for k, v in module._buffers.items() if v is not None}
        built = {k: v for k, v in module._buffers.items() if v is not None and not v.is_meta}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed * 1_000_003 + self.order[path])
            with torch.no_grad():
                if self.init_fn is not None:
                    self.init_fn(alone)
                elif hasattr(alone, "reset_parameters"):
                    alone.reset_parameters()
                elif alone._parameters or alone._buffers:
                    raise InputError(
                        f"the model is on the meta device and module {path or '<root>'!r} "
                        f"({type(module).__name__}) owns parameters or buffers but has no reset_parameters(); "
                        "pass param_init_fn=fn to dsfunc.init_state, where fn(module) fills them in place"
                    )
        for k, buffer in built.items():  # a buffer keeps its value (a meta model's parameters have none)
            alone._buffers[k].copy_(buffer)
        return {**alone._parameters, **alone._buffers}
