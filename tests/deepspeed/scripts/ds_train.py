"""A training script written against DeepSpeed's engine API (getting-started tutorial style).

Trains to ``--steps`` optimizer steps; ``--save_at N`` saves a checkpoint with client state after step
N; ``--load_dir`` resumes from the latest checkpoint there. Writes, per rank, ``<out>.rank<r>.pt`` with
the final parameters (``engine.module``, gathered), the losses of the steps it ran and the engine's counters.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dsfunc as deepspeed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1)) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.out(h).float(), y)


parser = argparse.ArgumentParser(description="engine API script")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--save_dir", default=None)
parser.add_argument("--save_at", type=int, default=-1)
parser.add_argument("--load_dir", default=None)
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(40, 6, generator=generator), torch.randint(0, 4, (40,), generator=generator))
net = Net()
model_engine, optimizer, data_loader, lr_scheduler = deepspeed.initialize(
    args=args, model=net, model_parameters=net.parameters(), training_data=dataset)

losses = {}
client_sd = {}
if args.load_dir is not None:
    load_path, client_sd = model_engine.load_checkpoint(args.load_dir)
    assert load_path is not None, "nothing to resume from"
    assert client_sd["step"] == model_engine.global_steps
    # no dataloader_to_step(...): the engine's loader resumes at the saved step by itself

done = model_engine.global_steps
while done < args.steps:
    for x, y in data_loader:
        loss = model_engine(x, y)
        model_engine.backward(loss)
        model_engine.step()
        if model_engine.global_steps == done:
            continue  # inside a gradient-accumulation window
        done = model_engine.global_steps
        losses[done] = model_engine.state.metrics.loss.item()
        if done == args.save_at:
            client_sd["step"] = done
            client_sd["note"] = f"saved at {done}"
            model_engine.save_checkpoint(args.save_dir, client_sd=client_sd)
        if done == args.steps:
            break

with deepspeed.zero.GatheredParameters(list(model_engine.module.parameters())):  # full at ZeRO-3 too
    params = {k: v.clone() for k, v in model_engine.module.state_dict().items()}
torch.save({
    "params": params,
    "losses": losses,
    "global_steps": model_engine.global_steps,
    "global_samples": model_engine.global_samples,
    "skipped_steps": model_engine.skipped_steps,
    "lr": model_engine.get_lr(),
    "lr_scheduler": lr_scheduler.state_dict(),
    "client_sd": client_sd,
    "loader": (data_loader.epoch, data_loader.offset),
}, f"{args.out}.rank{model_engine.global_rank}.pt")
