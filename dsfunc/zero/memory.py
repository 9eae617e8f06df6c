"""What each rank holds for the model states, by category, as the ZeRO stage lays them out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import optree
import torch

from dsfunc.optim.low_precision import compensations
from dsfunc.zero.reduce import grad_dtype, sum_dtype

if TYPE_CHECKING:
    from dsfunc.state import TrainState


def memory_estimate(state: TrainState) -> dict[str, int]:
    """Bytes each rank holds for the model states, by category, as the ZeRO stage lays them out.

    ``master`` (the master weights, fp32 or bf16, and with ``bf16.rounding = "kahan"`` their bf16 compensations:
    this rank's shard, measured in the state), ``optimizer`` (moments etc., measured in the state),
    ``gradients`` (the full flat at stages 0-1, the shard at 2-3, in :func:`~dsfunc.zero.reduce.grad_dtype`:
    bf16 for one micro-batch on one rank when the update reads 16-bit gradients, or always with
    ``bf16_master_weights_and_grads``, else fp32; none with the
    optimizer offloaded, but at stage 1 with gradient accumulation, and the sums of the units that
    ``grad_accumulation_on_device`` keeps there until the host update reads them), ``compute`` (the compute-dtype copy
    forward reads: none at stage 0 in fp32, where it aliases the master; the whole model at
    stages 1-2; at stage 3 the persistent units plus the two largest gathered units, and with the optimizer
    offloaded but not the parameters each gathered unit's shard kept between gathers), ``buffers`` (buffers
    and frozen parameters), ``host_buffers`` (offload: the host copies of the gradient and compute-dtype
    shards), and where they are: ``device``, ``host`` (master, optimizer and host buffers when the optimizer
    is offloaded, else 0) and their ``total``. Activations are not included.
    """
    program = state.program
    plan = program.plan
    run = program.run
    host_masters = run.placement.masters is not None
    lazy = [u for u in plan.units if run.workspace.lazy(u)]
    cbytes = torch.empty((), dtype=program.compute_dtype).element_size()
    gas = program.config.gradient_accumulation_steps
    sums = sum_dtype(program.config)
    kept = grad_dtype(program.compute_dtype, program.comm_dtype, plan.world_size, gas, sums)
    narrow = program.update.reads_16_bit_grads or sums != torch.float32
    gbytes = (kept if narrow else torch.float32).itemsize
    full = sum(u.numel for u in plan.units)
    shard = sum(plan.shard_size(u) for u in plan.units)
    if run.workspace.aliases_master:
        compute = 0
    else:
        persistent = sum(plan.padded_size(u) for u in plan.units if u not in lazy)
        largest = sorted((plan.padded_size(u) for u in lazy), reverse=True)[:2]
        kept = run.workspace.source.device_elements(sum(plan.shard_size(u) for u in lazy))
        compute = (persistent + sum(largest) + kept) * cbytes
    compensation = sum(c.nbytes for c in compensations(state.opt_state))
    out = {
        "master": sum(p.nbytes for p in state.params.values()) + compensation,
        "optimizer": sum(t.nbytes for t in optree.tree_leaves(state.opt_state) if t.dim() > 0) - compensation,
        "gradients": run.grads.device_bytes(gbytes * (full if plan.stage <= 1 else shard)),
        "compute": compute,
        "buffers": sum(t.numel() * t.element_size() for t in state.buffers.values()),
        "host_buffers": run.host_bytes(),
    }
    host = 0 if not host_masters else out["master"] + out["optimizer"] + out["host_buffers"]
    out["device"] = sum(out.values()) - host
    out["host"] = host
    out["total"] = out["device"] + host
    return out
