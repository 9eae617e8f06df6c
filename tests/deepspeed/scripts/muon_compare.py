"""One engine-API script for real DeepSpeed and for dsfunc (``--backend``) with ``"type": "Muon"``: embeddings,
hidden matrices (two of them split across 2 ranks' ZeRO partitions), norms and an LM head, ZeRO stages 0-3.
Writes ``<out>.<backend>.rank<r>.pt`` with each stage's losses and the (gathered) parameters after every step.
``--clip`` applies at ``--clip_stages`` only: DeepSpeed's ZeRO 1-3 take the norm over Muon's orthogonalised update
and clip that (its stage 0, like dsfunc at every stage, clips the gradients Muon's momentum takes in).

    DS_ACCELERATOR=cpu TORCHDYNAMO_DISABLE=1 torchrun --nproc_per_node 2 tests/deepspeed/scripts/muon_compare.py \
        --backend deepspeed --out x
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
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument(
    "--clip_stages", default="0", help="the stages that clip (DeepSpeed's ZeRO 1-3 clip Muon's update)"
)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed = importlib.import_module(args.backend)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
MICRO, VOCAB = 2, 11


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.proj = nn.Linear(6, 7, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.back = nn.Linear(7, 6, bias=False)
        self.lm_head = nn.Linear(6, VOCAB)

    def forward(self, x):
        h = self.proj(self.embed(x))
        for block in self.blocks:
            h = h + block(self.back(h))[..., :1]
        return self.lm_head(self.back(h))


def train(stage):
    torch.manual_seed(0)
    net = Net()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {
            "type": "Muon",
            "params": {"muon_lr": 0.03, "adam_lr": 0.01, "weight_decay": 0.1, "torch_adam": True},
        },
        "gradient_clipping": args.clip if str(stage) in args.clip_stages.split(",") else 0.0,
        "zero_optimization": {
            "stage": stage,
            "reduce_scatter": stage < 3,
        },  # DeepSpeed's ZeRO-3 Muon needs it off
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(7)
    losses, steps = [], []
    for _ in range(args.steps):
        x = torch.randint(0, VOCAB, (world * MICRO, 5), generator=g)
        y = torch.randint(0, VOCAB, (world * MICRO, 5), generator=g)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = F.cross_entropy(engine(x[mine]).flatten(0, 1), y[mine].flatten())
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
