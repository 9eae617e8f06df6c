"""What each rank holds for the model states, by category, as the ZeRO stage lays them out."""

from __future__ import annotations

from typing import Any

import optree
import torch


def memory_estimate(state: Any) -> dict[str, int]:
    """Bytes each rank holds for the model states, by category, as the ZeRO stage lays them out.

    ``master`` (fp32 weights: this rank's shard), ``optimizer`` (moments etc., measured in the state),
    ``gradients`` (fp32: the full flat at stages 0-1, the shard at 2-3), ``compute`` (the compute-dtype
    copy forward reads: none at stage 0 in fp32, where it aliases the master; the whole model at
    stages 1-2; at stage 3 the persistent units plus the two largest gathered units), ``buffers``
    (buffers and frozen parameters), and their ``total``. Activations are not included.
    """
    program = state.program
    plan = program.plan
    lazy = [u for u in plan.units if program.workspace.lazy(u)]
    cbytes = torch.empty((), dtype=program.compute_dtype).element_size()
    full = sum(u.numel for u in plan.units)
    shard = sum(plan.shard_size(u) for u in plan.units)
    if program.workspace.aliases_master:
        compute = 0
    else:
        persistent = sum(plan.padded_size(u) for u in plan.units if u not in lazy)
        largest = sorted((plan.padded_size(u) for u in lazy), reverse=True)[:2]
        compute = (persistent + sum(largest)) * cbytes
    out = {
        "master": sum(p.numel() * p.element_size() for p in state.params.values()),
        "optimizer": sum(t.numel() * t.element_size() for t in optree.tree_leaves(state.opt_state) if t.dim() > 0),
        "gradients": 4 * (full if plan.stage <= 1 else shard),
        "compute": compute,
        "buffers": sum(t.numel() * t.element_size() for t in state.buffers.values()),
    }
    out["total"] = sum(out.values())
    return out
