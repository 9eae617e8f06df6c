"""One engine-API script for real DeepSpeed and for dsfunc (``--backend``): an unseeded model (every rank builds
its own random init; rank 0's is broadcast), ZeRO stages 0-3 on the ranks it is launched on, gradient
accumulation, clipping and WarmupLR. Writes ``<out>.<backend>.rank<r>.pt`` with each stage's micro-batch
losses, what ``engine.backward`` returned for each, and the final (gathered) parameters.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/deepspeed/scripts/ds_compare.py --backend deepspeed --out x
"""

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import leave_together

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
parser.add_argument("--stages", default="0,1,2,3")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed = importlib.import_module(args.backend)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
MICRO, GAS = 2, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def train(stage):
    torch.manual_seed(1000 + rank)  # unseeded alike: each rank its own init, as a script that never seeds
    net = Net()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(7)
    losses, returned = [], []
    for _ in range(args.steps):
        x = torch.randn(world * MICRO * GAS, 6, generator=g)
        y = torch.randint(0, 4, (world * MICRO * GAS,), generator=g)
        mine = slice(rank * MICRO * GAS, (rank + 1) * MICRO * GAS)
        for i in range(GAS):
            part = slice(i * MICRO, (i + 1) * MICRO)
            loss = F.cross_entropy(engine(x[mine][part]), y[mine][part])
            returned.append(engine.backward(loss).item())
            engine.step()
            losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        params = {k: v.detach().clone().float() for k, v in net.state_dict().items()}
    return {"losses": losses, "returned": returned, "params": params}


results = {int(s): train(int(s)) for s in args.stages.split(",")}
torch.save(results, f"{args.out}.{args.backend}.rank{rank}.pt")
if rank == 0:
    print(f"{args.backend}: stages {sorted(results)} done", flush=True)
leave_together()
