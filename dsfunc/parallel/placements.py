"""Where each parameter lives on the mesh, for a notebook: its tp placement and how ZeRO holds it over dp x sp, or,
for an expert, how its experts are split over ep and how ZeRO holds it over its expert-data-parallel ranks."""

from __future__ import annotations

from typing import Any

from dsfunc.experts.placement import expert_split


def placements(state: Any) -> dict[str, dict[str, str]]:
    """Parameter name -> ``{"tp": "Shard(dim=0)" | "Shard(dim=1)" | "Replicate()", "dp_sp": "Shard(0) of the flat unit
    <unit>" | "Replicate()"}``: its torch placement over the mesh's tp axis, and over ZeRO's ranks (the
    unit's flat buffer split like ``torch.chunk`` at stages 1-3, whole on every rank at stage 0).

    An expert's parameter (AutoEP or DeepSpeed's ``MoE``, its experts over more than one rank) has ``"ep"`` and
    ``"edp"`` instead of ``"dp_sp"``: ``"Shard(dim=0) over ranks (...)"`` (AutoEP's stacked experts, each ep rank a
    dim-0 slice) or ``"its own experts on each of ranks (...)"`` (``MoE``'s one module per expert), and ZeRO's
    placement over the expert-data-parallel ranks its gradients are reduced over, which name themselves."""
    program = state.program
    plan, tensor = program.plan, program.tensor
    out = {}
    for unit in plan.units:
        ways = plan.ways_of(unit)
        zero = f"Shard(0) of the flat unit {unit.name!r}" if ways > 1 else "Replicate()"
        split = expert_split(program.skeleton, unit)
        where = {"dp_sp": zero}
        if split is not None and split.ep.size > 1:
            ranks = f"ranks {split.ep.ranks}"
            edp = plan.group_of(unit).ranks
            where = {"ep": f"Shard(dim=0) over {ranks}" if split.stacked else f"its own experts on each of {ranks}",
                     "edp": f"{zero} over ranks {edp}" if ways > 1 else "Replicate()"}
        for slot in unit.params:
            tp_split = tensor.split.get(slot.name) if tensor is not None else None
            tp = ", ".join(repr(p) for p in tp_split.placements) if tp_split is not None else "Replicate()"
            out[slot.name] = {"tp": tp, **where}
    return out
