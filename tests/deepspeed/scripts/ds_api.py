"""A script written against DeepSpeed's module API (only the import changed): get_accelerator(), deepspeed.comm,
zero.Init, GatheredParameters, safe_get_full_fp32_param and save_16bit_model.

    dsfunc --num_gpus 2 tests/deepspeed/scripts/ds_api.py --stage 3 --out /tmp/ds_api
"""

import argparse
import json

import torch
import torch.nn.functional as F
from dsfunc.accelerator import get_accelerator
from dsfunc.utils import safe_get_full_fp32_param
from torch import nn

import dsfunc as deepspeed
from dsfunc import comm as dist


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return F.cross_entropy(self.head(h).float(), y)


parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
get_accelerator().set_device(max(args.local_rank, 0))
device = torch.device(get_accelerator().device_name(dist.get_local_rank()))
ds_config = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0,
                          "stage3_gather_16bit_weights_on_model_save": True},
}
torch.manual_seed(0)  # zero.Init keeps what construction drew (rank 0's)
with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=args.stage == 3):
    model = Net()
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
assert engine.zero_optimization_stage() == args.stage and engine.module is model

g = torch.Generator().manual_seed(0)
rank, world = dist.get_rank(), dist.get_world_size()
losses = []
for step in range(args.steps):
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    per_rank = 8 // world
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    for micro in range(per_rank // 4):
        part = slice(micro * 4, (micro + 1) * 4)
        loss = engine(x[part].to(device), y[part].to(device))
        engine.backward(loss)
        engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses.append(total.item() / world)

with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
    if rank == 0:  # the usual rank-0 surgery: what rank 0 writes becomes every rank's weight
        model.head.weight.data.mul_(0.5)
written = safe_get_full_fp32_param(model.head.weight)
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    seen = model.head.weight.detach().clone()
dist.barrier()
saved = engine.save_16bit_model(args.out)
if rank == 0:
    print(json.dumps({"losses": losses, "saved": saved, "world": world, "head_sum": written.sum().item(),
                      "seen_equal": torch.equal(seen.float(), written),
                      "memory": get_accelerator().max_memory_allocated() > 0}))
