"""One engine-API script for real DeepSpeed and for dsfunc (``--backend``) with bf16 master weights, gradients and
optimizer states (``bf16.bf16_master_weights_and_grads``, ``bf16.bf16_optimizer_states``) at ZeRO stages 1-3.
Writes ``<out>.<backend>.rank<r>.pt`` with each stage's losses and the (gathered) parameters after every step.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/deepspeed/scripts/bf16_states_compare.py --backend deepspeed --out x
"""

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import leave_together

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
parser.add_argument("--stages", default="1,2,3")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--optimizer", default="AdamW")
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed = importlib.import_module(args.backend)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
MICRO = 4
PARAMS = {"AdamW": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}, "SGD": {"lr": 0.05, "momentum": 0.9}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def train(stage):
    torch.manual_seed(0)
    net = Net()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": args.optimizer, "params": PARAMS[args.optimizer]},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(7)
    losses, steps = [], []
    for _ in range(args.steps):
        x = torch.randn(world * MICRO, 6, generator=g)
        y = torch.randint(0, 4, (world * MICRO,), generator=g)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = F.cross_entropy(engine(x[mine].bfloat16()).float(), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        with deepspeed.zero.GatheredParameters(list(net.parameters())):
            steps.append({k: v.detach().clone().float() for k, v in net.state_dict().items()})
    return {"losses": losses, "params": steps}


results = {int(s): train(int(s)) for s in args.stages.split(",")}
torch.save(results, f"{args.out}.{args.backend}.rank{rank}.pt")
if rank == 0:
    print(f"{args.backend}: stages {sorted(results)} done", flush=True)
leave_together()
