"""The ZeRO layout: parameters grouped into units, each a flat buffer split over ranks like ``torch.chunk``.

Parameters are grouped into **units** (default: each block of the model's largest ``nn.ModuleList``, plus
a root unit for everything else). A unit's parameters live in one flat buffer in a fixed order that does
not depend on the world size; the buffer is split like ``torch.chunk``: ``S = ceil(N / W)`` elements per
rank, padding only at the tail. That is why a checkpoint saved at one world size loads at another.

With parameter groups (a label per parameter, :class:`dsfunc.ParamGroups`) a unit holds one group's
parameters of one module, ``"<module>[<label>]"``, so each unit has one group's optimizer options and
the update applies them per unit; without groups the names are the plain ones (checkpoints stay
compatible).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dsfunc.distributed.comm import Group
from dsfunc.errors import InputError
from dsfunc.zero.leaf import leaf_units
from dsfunc.zero.placeholders import full_shape

ROOT = "root"


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One trainable parameter inside a unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    aliases: tuple[str, ...]  # every name the tensor is registered under (tied weights), canonical first

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Unit:
    """A group of parameters gathered, freed and reduced together."""

    name: str
    module: str | None  # the module whose forward brackets this unit's use; None for the root unit
    params: tuple[ParamSlot, ...]
    label: str | None = None  # the parameter group, when the plan has groups
    # the process group its gradients are reduced over and its values sharded over (ZeRO 1-3) or replicated within
    # (ZeRO 0), when not the plan's ranks: an expert's expert-data-parallel ranks (:mod:`dsfunc.experts`)
    group: Group | None = None

    @property
    def numel(self) -> int:
        last = self.params[-1]
        return last.offset + last.numel

    @functools.cached_property
    def sizes(self) -> list[int]:
        """The parameters' element counts, in layout order."""
        return [slot.numel for slot in self.params]

    @functools.cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """The parameters' shapes, in layout order."""
        return [tuple(slot.shape) for slot in self.params]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Units plus how this rank holds them. The flat layout is independent of ``world_size``."""

    units: tuple[Unit, ...]
    stage: int
    group: Group  # the ranks each unit is sharded and its gradients reduced over (the mesh's dp x sp)
    frozen: tuple[str, ...] = ()  # parameters that do not train: kept replicated, like buffers
    tp: Group | None = None  # the tensor-parallel ranks the parameters in ``split`` are split over
    split: frozenset[str] = frozenset()  # parameters whose values differ over tp (the others are replicated)

    @property
    def world_size(self) -> int:
        """The ranks of :attr:`group`."""
        return self.group.size

    @property
    def rank(self) -> int:
        """This rank's index in :attr:`group`."""
        return self.group.rank

    @property
    def ways(self) -> int:
        """Ranks the master weights and optimizer state of a unit without a group of its own are split over (1 at
        stage 0)."""
        return self.world_size if self.stage >= 1 else 1

    def group_of(self, unit: Unit) -> Group:
        """The ranks ``unit`` is sharded and its gradients reduced over: its own (an expert's) or the plan's."""
        return unit.group or self.group

    def ways_of(self, unit: Unit) -> int:
        """Ranks ``unit``'s master weights and optimizer state are split over (1 at stage 0)."""
        return self.group_of(unit).size if self.stage >= 1 else 1

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise InputError(f"no unit named {name!r}; units are {[u.name for u in self.units]}")

    def shard_size(self, unit: Unit) -> int:
        return -(-unit.numel // self.ways_of(unit))

    def padded_size(self, unit: Unit) -> int:
        return self.shard_size(unit) * self.ways_of(unit)

    def shard_bounds(self, unit: Unit) -> tuple[int, int]:
        """This rank's ``[start, stop)`` in the padded flat buffer: its shard (the whole unit at stage 0)."""
        ways = self.ways_of(unit)
        size = self.shard_size(unit)
        start = self.group_of(unit).rank * size if ways > 1 else 0
        return start, start + size

    def local_range(self, unit: Unit) -> tuple[int, int]:
        """This rank's ``[start, stop)`` in the unpadded flat buffer (may be empty); the whole unit when it
        is not sharded (stage 0: every rank holds all of it)."""
        ways = self.ways_of(unit)
        return chunk_range(unit.numel, ways, self.group_of(unit).rank if ways > 1 else 0)


def chunk_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index``'s ``[start, stop)`` of ``numel`` elements split like ``torch.chunk`` into ``parts``
    (``ceil(numel / parts)`` each, the last ones short or empty)."""
    size = -(-numel // parts)
    start = min(index * size, numel)
    return start, min(start + size, numel)


def find_unit_modules(model: nn.Module) -> list[str]:
    """Paths of the blocks of the model's largest ``nn.ModuleList`` (by parameter count)."""
    best, best_size = None, 0
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            size = sum(math.prod(full_shape(p)) for p in module.parameters())
            if size > best_size:
                best, best_size = path, size
    if best is None:
        return []
    return [f"{best}.{i}" if best else str(i) for i in range(len(model.get_submodule(best)))]


def make_plan(
    model: nn.Module,
    *,
    stage: int,
    group: Group,
    unit_modules: Sequence[str] | None = None,
    labels: Callable[[str], str] | None = None,
    own_groups: Mapping[str, Any] | None = None,
) -> ShardingPlan:
    """Group ``model``'s trainable parameters into units (``unit_modules`` overrides the default; ZeRO-3 leaf
    modules merge the units inside them, at every stage, :mod:`dsfunc.zero.leaf`).

    ``labels`` maps a parameter's (first) name to its parameter group: units are then split by it. ``own_groups``
    maps modules whose parameters are reduced over ranks of their own (experts) to that process group (None in one
    process: still a unit of its own, so the units are the same at every ep degree): each is a unit of its own, even
    inside another unit's module, sharded over that group at stages 1-3.
    """
    own_groups = dict(own_groups or {})
    modules = leaf_units(model, find_unit_modules(model) if unit_modules is None else unit_modules)
    modules = [*(m for m in modules if m not in own_groups), *own_groups]
    for path in modules:
        model.get_submodule(path)  # raises AttributeError naming the bad path
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        tensors[id(p)] = p

    def owner(name: str) -> str:
        for path in [*own_groups, *modules]:  # an expert module inside a unit's module owns its parameters
            if name.startswith(path + "."):
                return path
        return ROOT

    members: dict[tuple[str, str | None], list[tuple[str, tuple[str, ...], torch.Size]]] = {}
    for path in [ROOT, *modules]:
        members[path, None] = []
    frozen = []
    for pid, names in names_of.items():
        p = tensors[pid]
        if not p.requires_grad:
            frozen.append(names[0])
            continue
        owners = {owner(n) for n in names}
        key = (owners.pop() if len(owners) == 1 else ROOT, None if labels is None else labels(names[0]))
        members.setdefault(key, []).append((names[0], tuple(names), full_shape(p)))
    units = []
    for path in [ROOT, *modules]:
        for (where, label), params in members.items():
            if where != path or not params:
                continue
            placed, offset = [], 0
            for name, aliases, shape in params:
                placed.append(ParamSlot(name, tuple(shape), offset, aliases))
                offset += math.prod(shape)
            units.append(Unit(name=path if label is None else f"{path}[{label}]",
                              module=None if path == ROOT else path, params=tuple(placed), label=label,
                              group=own_groups.get(path)))
    if not units:
        raise InputError("the model has no trainable parameters (every parameter has requires_grad=False)")
    return ShardingPlan(tuple(units), stage, group, tuple(frozen))


@torch.no_grad()
def flatten_unit(unit: Unit, tensors: Mapping[str, torch.Tensor], padded: int) -> torch.Tensor:
    """One flat fp32 buffer of ``padded`` elements holding the unit's tensors in layout order."""
    first = tensors[unit.params[0].name]
    flat = torch.zeros(padded, dtype=torch.float32, device=first.device)
    for slot in unit.params:
        flat[slot.offset : slot.offset + slot.numel].copy_(tensors[slot.name].reshape(-1))
    return flat


def unit_views(unit: Unit, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like the unit's parameters (autograd: one ``cat`` in backward). Once per unit and
    micro-batch: the sizes are the unit's own, the split is torch's op without its Python wrapper."""
    pad = flat.numel() - unit.numel
    pieces = flat.split_with_sizes([*unit.sizes, pad] if pad else unit.sizes)
    return [piece.view(shape) for piece, shape in zip(pieces, unit.shapes)]


def local_shard(plan: ShardingPlan, unit: Unit, flat: torch.Tensor) -> torch.Tensor:
    """This rank's shard (a copy) of a padded flat buffer."""
    start, stop = plan.shard_bounds(unit)
    return flat[start:stop].clone()


