"""One DeepSpeed pipeline script for real DeepSpeed and for dsfunc (``--backend``): a PipelineModule whose input
embedding and output head are one TiedLayerSpec, split over 2 stages (times the data-parallel ranks left), trained
with ``engine.train_batch``. Writes ``<out>.<backend>.rank<r>.pt`` with the losses train_batch returned and this
stage's parameters.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/pipeline/pipe_compare.py --backend deepspeed --out x
"""

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--out", required=True)
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed = importlib.import_module(args.backend)
pipe = importlib.import_module(f"{args.backend}.pipe")
deepspeed.init_distributed(dist_backend="gloo")
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
VOCAB, DIM, SEQ, MICRO, GAS, STAGES = 16, 8, 5, 2, 4, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


def head(embedding, h):
    return h @ embedding.weight.t()


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


torch.manual_seed(1234)
layers = [
    pipe.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
    pipe.LayerSpec(Block), pipe.LayerSpec(Block), pipe.LayerSpec(Block),
    pipe.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head),
]
model = pipe.PipelineModule(layers=layers, num_stages=STAGES, loss_fn=loss_fn, partition_method="uniform")
config = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
    "gradient_clipping": args.clip,
    "steps_per_print": 1000,
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
dp = world // STAGES
dp_rank = rank % dp  # both lay ranks out as stage * dp + replica
g = torch.Generator().manual_seed(7)
losses = []
for _ in range(args.steps):
    tokens = torch.randint(0, VOCAB, (dp * GAS * MICRO, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    mine = range(dp_rank * GAS * MICRO, (dp_rank + 1) * GAS * MICRO, MICRO)
    batches = iter([(tokens[i:i + MICRO], labels[i:i + MICRO]) for i in mine])
    losses.append(float(engine.train_batch(batches)))
params = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
torch.save({"losses": losses, "params": params, "stage": engine.stage_id}, f"{args.out}.{args.backend}.rank{rank}.pt")
print(f"{args.backend} rank {rank}: losses {losses}", flush=True)
