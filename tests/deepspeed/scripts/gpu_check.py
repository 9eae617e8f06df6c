"""Engine vs functional API on CUDA ranks (NCCL): ZeRO stages 0 and 3, fp32 and bf16, gradient accumulation.

    torchrun --nproc_per_node 2 tests/deepspeed/scripts/gpu_check.py     # prints one line per case, rank 0
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch

import dsfunc
from dsfunc.deepspeed import initialize
from tests.models import MLP, config, mlp_batches, relative_diff

dsfunc.init_distributed()
rank, world = dsfunc.get_rank(), dsfunc.get_world_size()
failures = 0
for precision in (None, "bf16"):
    for stage in (0, 3):
        gas, micro = 2, 2
        cfg = config(micro=micro, gas=gas, world=world, stage=stage)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if precision:
            cfg[precision] = {"enabled": True}
        n = micro * gas
        batches = [(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]) for x, y in mlp_batches(5, n * world)]
        torch.manual_seed(0)
        state = dsfunc.init_state(MLP(width=10, depth=3, dropout=0.1), cfg)
        for batch in batches:
            state = dsfunc.train_step(state, batch)
        torch.manual_seed(0)
        engine, *_ = initialize(model=MLP(width=10, depth=3, dropout=0.1), config=cfg)
        for x, y in batches:
            for i in range(gas):
                engine.backward(engine(x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]))
                engine.step()
        diff = relative_diff(dsfunc.full_params(engine.state), dsfunc.full_params(state))
        with torch.no_grad():
            out = engine.eval()(batches[0][0])
            expected = engine.module(batches[0][0].to(engine.device))  # the model itself, trained in place
        engine.train()
        eval_diff = (out.float() - expected.float()).abs().max().item()
        ok = diff == 0.0 and out.device == engine.device and eval_diff < 0.05
        failures += not ok
        if rank == 0:
            print(f"{engine.device} precision={precision or 'fp32'} stage={stage}: engine vs functional rel diff {diff}, "
                  f"eval vs module max diff {eval_diff:.2e}, {'OK' if ok else 'FAIL'}", flush=True)
sys.exit(1 if failures else 0)
