"""One engine-API script for real DeepSpeed and for dsfunc (``--backend``): ``data_types.buffer_dtype`` casts the
module's floating buffers (a rotary-style ``inv_freq``), not its integer ones, at ZeRO stages 0 and 3 under bf16,
and training goes on with them. Writes ``<out>.<backend>.rank<r>.pt``: per (buffer_dtype, stage), the buffers'
dtypes and values after two steps, the losses and the final (gathered) parameters.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/deepspeed/scripts/ds_buffer_dtype.py --backend deepspeed --out x
"""

import torch
from torch import nn

from tests.multiprocess import backend, leave_together

deepspeed, args = backend()
rank = deepspeed.comm.get_rank()


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(8.0) / 8))
        self.register_buffer("positions", torch.arange(8))

    def forward(self, x, y):
        h = torch.cos(self.inp(x) * self.inv_freq.to(x.dtype) + self.positions.to(x.dtype))
        return ((self.out(h).float() - y) ** 2).mean()


def run(buffer_dtype, stage):
    torch.manual_seed(0)
    net = Rotary()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_allow_untested_optimizer": True,
              "data_types": {} if buffer_dtype is None else {"buffer_dtype": buffer_dtype}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(2):
        x, y = torch.randn(2, 4, generator=g).bfloat16(), torch.randn(2, 1, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"buffers": {k: (str(v.dtype), v.clone()) for k, v in engine.module.named_buffers()}, "losses": losses}
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        out["params"] = {k: p.detach().float().clone() for k, p in net.named_parameters()}
    return out


torch.save({(d, s): run(d, s) for d in ("bf16", "fp16") for s in (0, 3)}, f"{args.out}.{args.backend}.rank{rank}.pt")
leave_together()
