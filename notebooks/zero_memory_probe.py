"""Measure what one rank holds at each ZeRO stage; run by 02_zero_memory.ipynb through the dsfunc launcher.

    python -m dsfunc.cli --num_gpus 4 zero_memory_probe.py --out measured/

Every rank trains the same small bf16 model for two steps at ZeRO stages 0-3 and writes
``<out>/world<W>_rank<R>.json``: the bytes of the tensors it holds, by category, read from the tensors
themselves (storage sizes), not computed from a formula.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import optree
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc


class Tower(nn.Module):
    """A stack of equal blocks (the ZeRO units) between a small input and output layer (the root unit)."""

    def __init__(self, features: int = 16, width: int = 256, depth: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.out(h).float(), y)


def config(stage: int, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def nbytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the storages under ``tensors``, each once (several units' gradients may be slices of one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(stage: int, rank: int, steps: int = 2, micro: int = 8) -> dict:
    """Train ``steps`` steps at ``stage``; return what this rank holds after the last one."""
    torch.manual_seed(0)
    state = dsfunc.init_state(Tower(), config(stage, micro))
    grad_bytes: list[int] = []

    def record_grads(inner):
        """A gradient transform that notes the bytes of the reduced gradients handed to the update."""

        def grad_fn(ctx, batch):
            result = inner(ctx, batch)
            grad_bytes.append(nbytes([g for g in result.grads.values() if g is not None]))
            return result

        return grad_fn

    step = dsfunc.make_train_step(record_grads(dsfunc.default_grad_fn()))
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(micro, 16, generator=g), torch.randint(0, 10, (micro,), generator=g)
        state = step(state, (x, y))
    workspace = state.program.run.workspace  # the bf16 compute copy (stage 3: gathered blocks already freed)
    moments = [t for t in optree.tree_leaves(state.opt_state) if t.dim() > 0]  # counters are 0-d
    return {
        "compute_params": nbytes(list(workspace.buffers.values())),
        "master_params": nbytes(list(state.params.values())),  # this rank's fp32 master shard
        "grads": grad_bytes[-1],
        "optimizer": nbytes(moments),
        "max_live_units": workspace.stats.max_live_units,
        "loss": state.metrics.loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory for the per-rank JSON files")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher; unused")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        dsfunc.init_distributed(verbose=False)
    rank, world = dsfunc.get_rank(), dsfunc.get_world_size()
    result = {
        "rank": rank,
        "world_size": world,
        "stages": {stage: measure(stage, rank) for stage in range(4)},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"world{world}_rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
