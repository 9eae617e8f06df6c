"""Where each parameter lives on the mesh, for a notebook: its tp placement and how ZeRO holds it over dp x sp."""

from __future__ import annotations

from typing import Any


def placements(state: Any) -> dict[str, dict[str, str]]:
    """Parameter name -> ``{"tp": "Shard(dim=0)" | "Shard(dim=1)" | "Replicate()", "dp_sp": "Shard(0) of the flat unit
    <unit>" | "Replicate()"}``: its torch placement over the mesh's tp axis, and over ZeRO's ranks (the
    unit's flat buffer split like ``torch.chunk`` at stages 1-3, whole on every rank at stage 0)."""
    program = state.program
    plan, tensor = program.plan, program.tensor
    out = {}
    for unit in plan.units:
        zero = f"Shard(0) of the flat unit {unit.name!r}" if plan.ways > 1 else "Replicate()"
        for slot in unit.params:
            split = tensor.split.get(slot.name) if tensor is not None else None
            tp = ", ".join(repr(p) for p in split.placements) if split is not None else "Replicate()"
            out[slot.name] = {"tp": tp, "dp_sp": zero}
    return out
