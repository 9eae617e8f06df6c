"""One engine-API script for real DeepSpeed and for dsfunc (``--backend``): ``deepspeed.utils.safe_get_full_grad``
after every backward (gradient accumulation 2, ZeRO stages 0-3, on the ranks it is launched on) and
``safe_set_full_grad`` before the last step (lr 0 before it: the gradients do not depend on the optimizer's
rounding; 0.01 for it: the parameter shows the set gradient applied); a frozen
parameter's answers. Writes ``<out>.<backend>.rank<r>.pt``: per stage, each read gradient (or ``"ValueError"`` where
the helper raised), what the frozen parameter gave, the set gradient read back, a gradient
``safe_update_full_grad_vectorized`` rewrote read back, then the set parameter. With
``--offload``, stages 1-3 with the optimizer offloaded to the host.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/deepspeed/scripts/ds_full_grad.py --backend deepspeed --out x
"""

import argparse
import importlib

import torch
from torch import nn

from tests.multiprocess import leave_together

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--offload", action="store_true")
args = parser.parse_args()
deepspeed = importlib.import_module(args.backend)
utils = importlib.import_module(f"{args.backend}.utils")
deepspeed.init_distributed(dist_backend="gloo")
rank = deepspeed.comm.get_rank()


def run(stage):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].bias.requires_grad_(False)  # frozen: DeepSpeed's helpers answer None for it
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.0, "torch_adam": True}}}
    if args.offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # DeepSpeed's offloaded step clips by the norm taken as the gradients went to the host, before the set one
        # replaced them; dsfunc's by the norm of what it applies (as DeepSpeed's without offload): clipping off
        config["gradient_clipping"] = 0.0
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data: reduced and local gradients differ
    seen = []
    for i in range(4):
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)
        engine.backward(((engine(x) - y) ** 2).mean())
        try:
            seen.append(utils.safe_get_full_grad(net[0].weight).clone())
        except ValueError:
            seen.append("ValueError")
        frozen = [utils.safe_get_full_grad(net[0].bias), utils.safe_get_full_fp32_param(net[0].bias),
                  utils.safe_get_full_optimizer_state(net[0].bias, "exp_avg")]
        seen.append("frozen: None" if all(v is None for v in frozen) else "frozen: a value")
        if i == 3:
            utils.safe_set_full_grad(net[2].bias, torch.tensor([3.0, -2.0]))
            seen.append(utils.safe_get_full_grad(net[2].bias).clone())
            utils.safe_update_full_grad_vectorized([net[0].weight, net[0].bias], lambda old, p: old * -3.0)
            seen.append(utils.safe_get_full_grad(net[0].weight).clone())
            for group in engine.optimizer.param_groups:  # this step moves the parameter by the set gradient
                group["lr"] = 0.01
        engine.step()
    with deepspeed.zero.GatheredParameters([net[2].bias]):
        seen.append(net[2].bias.detach().float().clone())
    return seen


stages = range(1, 4) if args.offload else range(4)
torch.save({stage: run(stage) for stage in stages}, f"{args.out}.{args.backend}.rank{rank}.pt")
leave_together()
