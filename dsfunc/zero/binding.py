"""Binding: pointing the skeleton's parameter and buffer tables at this micro-batch's tensors, and at the
*resident* tensors between micro-batches.

For a micro-batch, each unit's parameters are bound as views of one flat autograd leaf (what
``torch.func.functional_call`` does, but per unit, so ZeRO-3 can bind a unit lazily inside the
forward), and the buffers as the state's tensors. A floating buffer of a module with parameters of its own
(BatchNorm's running statistics) is bound in the compute dtype, as its module's parameters are; one of a module
without (a rotary embedding's ``inv_freq``, a computed constant whose precision the positions need) keeps its
own dtype, as DeepSpeed 0.19.8 keeps fp32 buffers (``data_types.buffer_dtype`` casts them when the state is
built).

Between micro-batches the tables hold the residents: ``nn.Parameter`` objects whose data are views of
the workspace's persistent compute copies (:meth:`Binding.show`; at fp32 stage 0 the masters themselves,
in bf16/fp16 16-bit like DeepSpeed's module), empty tensors for a ZeRO-3 unit that is not gathered, and
the state's own buffers. So a module trained in place (``init_state(..., in_place=True)``, what the
DeepSpeed engine does) holds the live values after every update without a copy, and a module whose
parameters were real (or ``zero.Init``'s empty placeholders) keeps its parameter objects (only their
``.data`` changes). A resident replaces an object only where that is impossible: a parameter on ``meta``
(as the skeleton's copies of the module's parameters are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dsfunc.zero.layout import ShardingPlan
from dsfunc.zero.placeholders import ZeroParamStatus, next_ds_id

_Place = tuple[dict[str, Any], str]  # (module._parameters or ._buffers, attribute)


@dataclasses.dataclass
class _Site:
    """One tensor of the module: where it sits (every alias), and what sits there between micro-batches."""

    places: list[_Place]
    resident: Any
    is_param: bool


class Binding:
    """Where each unit's parameters (under every alias) and each buffer sit in the skeleton."""

    def __init__(self, skeleton: nn.Module, plan: ShardingPlan, buffer_names: Iterable[str]) -> None:
        def place(name: str) -> tuple[_Place, bool]:
            module, attr = _owner(skeleton, name), name.rpartition(".")[2]
            is_param = attr in module._parameters
            return ((module._parameters if is_param else module._buffers), attr), is_param

        def site(names: Sequence[str]) -> _Site:
            places = [place(n) for n in names]
            (table, attr), is_param = places[0]
            return _Site([p for p, _ in places], table[attr], is_param)

        self.plan = plan
        self.units: dict[str, list[_Site]] = {
            unit.name: [site(p.aliases) for p in unit.params] for unit in plan.units
        }
        self.buffers: dict[str, _Site] = {name: site([name]) for name in buffer_names}
        # the buffers bound in the compute dtype: those of modules with parameters of their own (see the docstring)
        self.cast_buffers = frozenset(
            name for name in self.buffers if any(v is not None for v in _owner(skeleton, name)._parameters.values())
        )
        self.bound = False

    def residents(self, unit: str) -> list[nn.Parameter]:
        """The parameter objects the module holds for ``unit`` between micro-batches (layout order)."""
        return [s.resident for s in self.units[unit]]

    def bind_unit(self, unit: str, views: Sequence[torch.Tensor]) -> None:
        self.bound = True
        for s, view in zip(self.units[unit], views):
            for table, attr in s.places:
                table[attr] = view

    def bind_buffers(self, buffers: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Callable[[], None]:
        """Bind ``buffers`` (the floating ones of :attr:`cast_buffers` cast to ``dtype``); return the function that
        writes the cast copies back into ``buffers`` (BatchNorm's running statistics change in forward)."""
        self.bound = True
        written = []
        for name, t in buffers.items():
            bound = t
            if name in self.cast_buffers and t.is_floating_point() and t.dtype != dtype:
                bound = t.to(dtype)
                written.append((t, bound))
            for table, attr in self.buffers[name].places:
                table[attr] = bound

        def write_back() -> None:
            with torch.no_grad():
                for t, bound in written:
                    t.copy_(bound)

        return write_back

    def restore(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Put the residents back, the buffers being ``buffers`` (the state's), so the skeleton keeps no
        reference to this micro-batch."""
        for name, t in buffers.items():
            self._show(self.buffers[name], t, requires_grad=False)
        for per_param in (*self.units.values(), [*self.buffers.values()]):
            for s in per_param:
                for table, attr in s.places:
                    table[attr] = s.resident
        self.bound = False

    def show(self, unit: str, views: Sequence[torch.Tensor], *, status: ZeroParamStatus | None = None) -> None:
        """Make ``unit``'s residents show ``views`` (in layout order). ``status`` (ZeRO-3 only) sets
        DeepSpeed's ``ds_status`` and the ``ds_id``/``ds_shape``/``ds_numel`` scripts read."""
        for s, view, p in zip(self.units[unit], views, self.plan.unit(unit).params):
            self._show(s, view, requires_grad=s.resident.requires_grad)
            if status is not None:
                resident = s.resident
                if not hasattr(resident, "ds_id"):
                    resident.ds_id = next_ds_id()
                    resident.ds_shape, resident.ds_numel = torch.Size(p.shape), p.numel
                resident.ds_status = status

    def _show(self, s: _Site, value: torch.Tensor, *, requires_grad: bool) -> None:
        """``s.resident`` shows ``value``: its ``.data`` becomes ``value`` when that can be done in place."""
        resident = s.resident
        if resident is value or (isinstance(resident, torch.Tensor) and resident.data_ptr() == value.data_ptr()
                                 and resident.shape == value.shape and resident.dtype == value.dtype
                                 and value.numel() > 0):
            return
        if s.is_param and isinstance(resident, nn.Parameter) and not resident.is_meta:
            resident.data = value
            return
        s.resident = nn.Parameter(value, requires_grad=requires_grad) if s.is_param else value
        if not self.bound:
            for table, attr in s.places:
                table[attr] = s.resident


def _owner(skeleton: nn.Module, name: str) -> nn.Module:
    """The module that holds the parameter or buffer ``name``."""
    path = name.rpartition(".")[0]
    return skeleton.get_submodule(path) if path else skeleton
