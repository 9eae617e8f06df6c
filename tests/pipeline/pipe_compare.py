"""One DeepSpeed pipeline script for real DeepSpeed and for dsfunc (``--backend``): a PipelineModule whose input
embedding and output head are one TiedLayerSpec, split over 2 stages (times the data-parallel ranks left), trained
with ``engine.train_batch``, then one ``engine.eval_batch``, a checkpoint, one more step and the checkpoint loaded
back (the evaluation and weights as saved). Writes ``<out>.<backend>.rank<r>.pt`` with the losses
train_batch returned, the evaluated loss and this stage's parameters.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/pipeline/pipe_compare.py --backend deepspeed --out x
"""

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import leave_together

parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--out", required=True)
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument("--training-data", action="store_true")
parser.add_argument("--stages", type=int, default=2)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed = importlib.import_module(args.backend)
pipe = importlib.import_module(f"{args.backend}.pipe")
deepspeed.init_distributed(dist_backend="gloo")
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
VOCAB, DIM, SEQ, MICRO, GAS, STAGES = 16, 8, 5, 2, 4, args.stages


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
if args.training_data:  # DeepSpeedExamples' pattern: built layers, a lambda, a criterion module, training_data
    layers = [nn.Embedding(VOCAB, DIM), Block(), Block(), lambda h: h.mean(1), nn.Linear(DIM, 3)]
    model = pipe.PipelineModule(layers=layers, num_stages=STAGES, loss_fn=nn.CrossEntropyLoss())
else:
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
dp = world // STAGES
dp_rank = rank % dp  # both lay ranks out as stage * dp + replica
g = torch.Generator().manual_seed(7)
data = None
if args.training_data:
    samples = torch.randint(0, VOCAB, (dp * GAS * MICRO * args.steps, SEQ), generator=g)
    data = torch.utils.data.TensorDataset(samples, samples[:, 0] % 3)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                       config=config, training_data=data)
losses = []
for _ in range(args.steps if args.training_data else 0):
    losses.append(float(engine.train_batch()))
for _ in range(0 if args.training_data else args.steps):
    tokens = torch.randint(0, VOCAB, (dp * GAS * MICRO, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    mine = range(dp_rank * GAS * MICRO, (dp_rank + 1) * GAS * MICRO, MICRO)
    batches = iter([(tokens[i:i + MICRO], labels[i:i + MICRO]) for i in mine])
    losses.append(float(engine.train_batch(batches)))
tokens = torch.randint(0, VOCAB, (dp * GAS * MICRO, SEQ), generator=g)
mine = range(dp_rank * GAS * MICRO, (dp_rank + 1) * GAS * MICRO, MICRO)
labels = tokens[:, 0] % 3 if args.training_data else torch.roll(tokens, -1, 1)
evaluated = float(engine.eval_batch(iter([(tokens[i:i + MICRO], labels[i:i + MICRO]) for i in mine])))
params = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
engine.save_checkpoint(f"{args.out}.{args.backend}.ckpt", tag="end")  # every stage, then back from disk
losses.append(float(engine.train_batch(iter([(tokens[i:i + MICRO], labels[i:i + MICRO]) for i in mine]))))
engine.load_checkpoint(f"{args.out}.{args.backend}.ckpt", tag="end")
reloaded = float(engine.eval_batch(iter([(tokens[i:i + MICRO], labels[i:i + MICRO]) for i in mine])))
assert abs(reloaded - evaluated) < 1e-6 and all(torch.equal(v.float(), params[k]) for k, v in model.state_dict().items())
torch.save({"losses": losses, "params": params, "stage": engine.stage_id, "eval": evaluated,
            "first": engine.is_first_stage(), "last": engine.is_last_stage()},
           f"{args.out}.{args.backend}.rank{rank}.pt")
print(f"{args.backend} rank {rank}: losses {losses}", flush=True)
leave_together()
