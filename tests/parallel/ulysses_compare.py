"""One DeepSpeed ALST script for real DeepSpeed and for dsfunc (``DSFUNC_AS_DEEPSPEED=1``): a tiny Hugging Face
Llama (GQA) with ``UlyssesSPAttentionHF.register_with_transformers``, ``deepspeed.initialize(mpu=...)``, batches
through ``UlyssesSPDataLoaderAdapter`` and the loss aggregated over the sp group by token counts as sums (a rank
whose positions are all padding adds 0). ``--loss alst``: as ALST's tutorial, through a differentiable all-reduce
(DeepSpeed's workaround: torch's differentiable all_gather mixes up ranks in backward over gloo when sp < world),
so every rank backpropagates the whole mean; ``--loss share``: as Hugging Face Trainer, each rank backpropagates its
own tokens' share. Writes ``<out>.rank<r>.pt`` with the losses, the final parameters (gathered at ZeRO-3) and the
grad norm of each step.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/parallel/ulysses_compare.py --out x --optimizer adamw
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

from tests.multiprocess import leave_together
from tests.parallel.ulysses_setup import ADAMW, MICRO, SEQ, SGD, STEPS, config, llama, rank_batch

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--optimizer", choices=["adamw", "sgd"], required=True)
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--clip", type=float, default=None, help="gradient_clipping instead of the optimizer's own")
parser.add_argument("--loss", choices=["alst", "share"], default="alst")
parser.add_argument("--steps", type=int, default=STEPS)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
SP = 2

deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
model = llama()
mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, MICRO, seq_length=SEQ)
if args.optimizer == "adamw":
    section = {**ADAMW, "optimizer": {"type": "AdamW", "params": {**ADAMW["optimizer"]["params"], "torch_adam": True}}}
    client = None
else:
    section = {"gradient_clipping": SGD["gradient_clipping"], "zero_allow_untested_optimizer": True}
    client = torch.optim.SGD(model.parameters(), **SGD["optimizer"]["params"])
if args.clip is not None:
    section["gradient_clipping"] = args.clip
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=client, mpu=mpu,
                                  config=config(section, sp=SP, stage=args.stage, gas=SP))
group = mpu.get_sequence_parallel_group()
loader = [rank_batch(step, rank) for step in range(args.steps)]
shards = UlyssesSPDataLoaderAdapter(loader, mpu.get_sequence_parallel_rank(), group, SP, engine.device)
losses, norms = [], []
for _ in range(args.steps):
    for _ in range(SP):  # one draw: every sp rank's batch, in turn
        shard = next(shards)
        logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        labels = shard["shift_labels"]
        local = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                reduction="sum")
        count = (labels != -100).sum().float()
        counts = [torch.zeros_like(count) for _ in range(SP)]
        dist.all_gather(counts, count, group=group)
        if args.loss == "alst":
            loss = dist_fn.all_reduce(local, group=group) / sum(counts)
        else:  # Trainer's: the value is the mean, the gradient is this rank's share of it
            loss = (local + (dist_fn.all_reduce(local.detach(), group=group) - local.detach())) / sum(counts)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    norms.append(float(engine.get_global_grad_norm()))
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
torch.save({"losses": losses, "norms": norms, "params": params}, f"{args.out}.rank{rank}.pt")
leave_together()
