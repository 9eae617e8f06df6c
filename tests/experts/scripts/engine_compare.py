"""One engine-API script with DeepSpeed's MoE layer, for real DeepSpeed and for dsfunc (``--backend``): a model
with an MoE layer between two dense layers, trained with ``loss + 0.01 * l_aux``, param groups split by
``split_params_into_different_moe_groups_for_optimizer``. Writes ``<out>.<backend>.rank<r>.pt`` with each
micro-batch's loss and l_aux and this rank's final parameters (its own experts').

``--case adam``: the config's Adam (torch_adam), WarmupLR, 2 micro-batches per step, top-1.
``--case sgd``: a client torch SGD with momentum and Nesterov, top-2 without token dropping, residual MoE (``--case
lamb``: the same layer, the config's Lamb, for dsfunc only: DeepSpeed's Lamb is a CUDA kernel); with
``--clip`` gradient clipping (not compared with DeepSpeed, whose stage-0 clipping with experts takes the mean of
the ranks' own norms rather than the model's norm; tests/experts/test_engine.py compares it with one process).
``--starve``: rank 1's tokens all alike, so it routes every token to one expert (two for top-2) and none to the
others. ``--one``: a frozen all-zero gate, so every rank routes every token to expert 0 (top-2: experts 0 and 1)
and the other experts get none on any rank. ``--seeded``: every rank builds the same initial weights (as the
one-process reference does). A dsfunc run also records each unit's elements and this rank's shard of them.
``--ep 1 --gas N`` on one process is the reference the clipped run is compared with (``--ranks`` the ranks of
the run it stands for: their batches are its micro-batches). ``--stage S``: ZeRO stage S (DeepSpeed's stages 1-2
with experts clip by the model's norm, so there the clipped run is compared with DeepSpeed's too).
"""

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import leave_together

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
parser.add_argument("--case", choices=["adam", "sgd", "lamb"], required=True)
parser.add_argument("--ep", type=int, default=2)
parser.add_argument("--gas", type=int, default=0)
parser.add_argument("--ranks", type=int, default=0)
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument("--starve", action="store_true")
parser.add_argument("--one", action="store_true")
parser.add_argument("--seeded", action="store_true", help="every rank the same initial weights")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--stage", type=int, default=0)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed = importlib.import_module(args.backend)
deepspeed.init_distributed(dist_backend="gloo")
MoE = importlib.import_module(f"{args.backend}.moe.layer").MoE
split_params_into_different_moe_groups_for_optimizer = importlib.import_module(
    f"{args.backend}.moe.utils").split_params_into_different_moe_groups_for_optimizer

rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
MICRO, EXPERTS = 6, 4
GAS = args.gas or (2 if args.case == "adam" else 1)
RANKS = args.ranks or world  # the ranks whose batches this run sees (one process: as micro-batches)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        expert = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
        if args.case == "adam":
            options = {"k": 1, "use_rts": False, "capacity_factor": 1.0, "min_capacity": 2}
        else:
            options = {"k": 2, "top2_2nd_expert_sampling": False, "drop_tokens": False, "use_residual": True}
        self.moe = MoE(8, expert, num_experts=EXPERTS, ep_size=args.ep, **options)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        mixed, l_aux, counts = self.moe(h)
        return self.out(h + mixed), l_aux, counts


def batches():
    """Every rank's micro-batches of one step, for all steps (the same on every rank)."""
    g = torch.Generator().manual_seed(5)
    for _ in range(args.steps):
        x = torch.randn(RANKS, GAS, MICRO, 5, generator=g)
        if args.starve:
            x[1] = x[1, 0, 0]  # rank 1: one token repeated, so one expert gets all of them
        yield x, torch.randint(0, 3, (RANKS, GAS, MICRO), generator=g)


def main():
    torch.manual_seed(1000 + (0 if args.seeded else rank))  # unseeded: experts come from their group's first rank
    net = Net()
    with torch.no_grad():  # a gate that does not route every token to one expert
        net.moe.deepspeed_moe.gate.wg.weight.copy_(torch.randn(EXPERTS, 8, generator=torch.Generator().manual_seed(3)))
        if args.one:  # equal scores: top-k picks the first experts, for every token
            net.moe.deepspeed_moe.gate.wg.weight.zero_().requires_grad_(False)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "dense"})
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS * (RANKS // world)}
    optimizer = None
    if args.case == "adam":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}
    elif args.case == "lamb":  # dsfunc only (DeepSpeed's Lamb is a CUDA kernel)
        config["optimizer"] = {"type": "Lamb", "params": {"lr": 0.01, "weight_decay": 0.01}}
    else:
        optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    if args.clip:
        config["gradient_clipping"] = args.clip
    if args.stage:
        config["zero_optimization"] = {"stage": args.stage}
        config["zero_allow_untested_optimizer"] = True  # the client SGD
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=groups if optimizer is None else None,
                                           optimizer=optimizer, config=config)
    record = {"loss": [], "l_aux": [], "counts": [], "norm": []}
    mine = [rank] if RANKS == world else range(RANKS)
    for x, y in batches():
        for r in mine:
            for i in range(GAS):
                logits, l_aux, counts = engine(x[r, i])
                loss = F.cross_entropy(logits, y[r, i]) + 0.01 * l_aux
                engine.backward(loss)
                engine.step()
                record["loss"].append(loss.item())
                record["l_aux"].append(l_aux.item())
                record["counts"].append(counts.tolist())
        if args.backend == "dsfunc" or args.stage:  # the step's gradient norm (DeepSpeed's stage 0 keeps none)
            record["norm"].append(float(engine.get_global_grad_norm()))
    record["params"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if args.backend == "dsfunc":
        plan = engine.state.program.plan
        record["shards"] = {u.name: (u.numel, engine.state.params[u.name].numel()) for u in plan.units}
    torch.save(record, f"{args.out}.{args.backend}.rank{rank}.pt")
    leave_together()


main()
