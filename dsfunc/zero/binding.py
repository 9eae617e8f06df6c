"""Binding: pointing the hook-free skeleton's parameter and buffer tables at this micro-batch's tensors.

The skeleton keeps ``meta`` placeholders between micro-batches, so it holds no reference to any step's
graph or buffers. For a micro-batch, each unit's parameters are bound as views of one flat autograd leaf
(what ``torch.func.functional_call`` does, but per unit, so ZeRO-3 can bind a unit lazily inside the
forward), and the buffers as the state's tensors (cast to the compute dtype when floating).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dsfunc.zero.layout import ShardingPlan

_Entry = tuple[dict[str, Any], str, Any]  # (module._parameters or ._buffers, attribute, meta placeholder)


class Slots:
    """Where each unit's parameters (under every alias) and each buffer sit in the skeleton."""

    def __init__(self, skeleton: nn.Module, plan: ShardingPlan, buffer_names: Iterable[str]) -> None:
        def place(name: str) -> _Entry:
            path, _, attr = name.rpartition(".")
            module = skeleton.get_submodule(path) if path else skeleton
            table = module._parameters if attr in module._parameters else module._buffers
            return table, attr, table[attr]

        self.units: dict[str, list[list[_Entry]]] = {
            unit.name: [[place(alias) for alias in slot.aliases] for slot in unit.params] for unit in plan.units
        }
        self.buffers: dict[str, _Entry] = {name: place(name) for name in buffer_names}

    def bind_unit(self, unit: str, views: Sequence[torch.Tensor]) -> None:
        for entries, view in zip(self.units[unit], views):
            for table, attr, _ in entries:
                table[attr] = view

    def bind_buffers(self, buffers: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Callable[[], None]:
        """Bind ``buffers`` (floating ones cast to ``dtype``); return the function that writes the cast
        copies back into ``buffers`` (BatchNorm's running statistics change in forward)."""
        written = []
        for name, t in buffers.items():
            bound = t
            if t.is_floating_point() and t.dtype != dtype:
                bound = t.to(dtype)
                written.append((t, bound))
            table, attr, _ = self.buffers[name]
            table[attr] = bound

        def write_back() -> None:
            with torch.no_grad():
                for t, bound in written:
                    t.copy_(bound)

        return write_back

    def restore(self) -> None:
        """Put the meta placeholders back so the skeleton keeps no reference to this micro-batch."""
        for per_param in self.units.values():
            for entries in per_param:
                for table, attr, placeholder in entries:
                    table[attr] = placeholder
        for table, attr, placeholder in self.buffers.values():
            table[attr] = placeholder
