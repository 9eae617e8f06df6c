"""One DeepSpeed AutoTP training script for real DeepSpeed and for dsfunc (``--backend dsfunc``: run with
``DSFUNC_AS_DEEPSPEED=1``, ``import deepspeed`` is dsfunc): the tiny Hugging Face Llama (GQA) of
:mod:`tests.parallel.tp_runs` with ``"tensor_parallel": {"autotp_size": 2}`` and ZeRO 1, the model's own loss,
each data-parallel replica (``rank // 2``: tp ranks are neighbours, in DeepSpeed and in dsfunc) on its slice of
the global batch. Writes ``<out>.<backend>.rank<r>.pt`` with each micro-batch's loss, the full parameters after
each step (a tp rank's parts gathered), the names of the weights split, and the micro-batch size and accumulation
steps the engine derived from the config.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/parallel/autotp_compare.py --backend deepspeed --out x
"""

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist

from tests.multiprocess import leave_together
from tests.parallel import tp_runs as runs

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
parser.add_argument("--stage", type=int, default=1)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
assert (deepspeed.__name__ == "dsfunc") == (args.backend == "dsfunc"), (deepspeed.__name__, os.environ)
TP = 2

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dp, dp_rank = world // TP, rank // TP
optimizer = {"adamw": {"type": "AdamW", "params": {**runs.ADAMW["params"], "torch_adam": True}},
             "sgd": runs.SGD}[args.optimizer]
config = {**runs.ds_config(optimizer, args.stage, dp, tp=TP), "steps_per_print": 1000}
if args.optimizer == "sgd":
    config["zero_allow_untested_optimizer"] = True
model = runs.llama()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def full_params() -> dict[str, torch.Tensor]:
    """Every parameter whole: a tp-split one gathered over its tp group (DeepSpeed's layers hold their part)."""
    if args.backend == "dsfunc":
        import dsfunc
        return dsfunc.full_params(engine.state)
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    out = {}
    for path, module in engine.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            value = p.detach()
            if isinstance(module, LinearLayer) or (isinstance(module, LinearAllreduce) and name == "weight"):
                dim = 0 if isinstance(module, LinearLayer) else 1  # not gather_params: it rebinds .data
                value = module._all_gather_shards(value, module._partition_sizes, dim)
            out[f"{path}.{name}" if path else name] = value.clone().float()
    return out

def split() -> list[str]:
    """The weights tensor parallelism split."""
    if args.backend == "dsfunc":
        import dsfunc.parallel
        return sorted(n for n, where in dsfunc.parallel.placements(engine.state).items() if "Shard" in where["tp"])
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    return sorted(f"{path}.weight" for path, m in engine.module.named_modules()
                  if isinstance(m, (LinearLayer, LinearAllreduce)))


losses, params = [], []
for step in range(runs.STEPS):
    mine = {k: v.chunk(dp)[dp_rank] for k, v in runs.batch(step).items()}
    for micro in range(config["gradient_accumulation_steps"]):
        loss = engine(**{k: v.chunk(2)[micro] for k, v in mine.items()}).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params.append(full_params())
batch = [engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()]
torch.save({"losses": losses, "params": params, "split": split(), "batch": batch}, f"{args.out}.{args.backend}.rank{rank}.pt")
leave_together()
