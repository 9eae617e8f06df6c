"""DeepSpeed's MoE layer, outside an engine, under whichever ``deepspeed`` imports (the real one, or dsfunc with
DSFUNC_AS_DEEPSPEED=1): for each gate configuration, the output, l_aux, exp_counts and the gradients of the
input and of every parameter after one backward, saved to ``<out>.rank<r>.pt``.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/experts/scripts/layer_compare.py OUT EP
"""

from __future__ import annotations

import sys

import deepspeed
import torch
from deepspeed.moe.layer import MoE
from torch import nn

from tests.multiprocess import leave_together

CASES = {
    "top1": {"k": 1, "use_rts": False},
    "top1_rts": {"k": 1},
    "top1_rsample": {"k": 1, "noisy_gate_policy": "RSample", "capacity_factor": 0.5},
    "top1_jitter_keep": {"k": 1, "noisy_gate_policy": "Jitter", "drop_tokens": False},
    "top2": {"k": 2, "capacity_factor": 0.75},
    "top2_nosample_keep": {"k": 2, "top2_2nd_expert_sampling": False, "drop_tokens": False},
    "top3": {"k": 3, "capacity_factor": 0.5},
    "residual": {"k": 1, "use_residual": True, "min_capacity": 0, "capacity_factor": 2.0},
    "eval": {"k": 2, "eval_capacity_factor": 0.25, "min_capacity": 1},
}


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))


def main(out: str, ep: int) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {}
    for name, options in CASES.items():
        torch.manual_seed(11)
        layer = MoE(6, expert(), num_experts=4, ep_size=ep, min_capacity=options.pop("min_capacity", 2), **options)
        layer.set_deepspeed_parallelism()
        if name == "eval":
            layer.eval()
        torch.manual_seed(100 + rank)
        x = torch.randn(3, 5, 6, requires_grad=True)
        out_, l_aux, counts = layer(x)
        (out_ * torch.linspace(-1, 1, out_.numel()).view_as(out_)).sum().add(0.1 * l_aux).backward()
        grads = {k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}
        results[name] = {"out": out_.detach(), "l_aux": l_aux.detach(), "counts": counts, "x_grad": x.grad,
                         "grads": grads, "names": sorted(k for k, _ in layer.named_parameters())}
    torch.save(results, f"{out}.rank{rank}.pt")
    leave_together()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
