"""One engine-API script for real DeepSpeed and for dsfunc (``--backend``): ``"managed_gradient_accumulation":
false``, where every ``engine.step()`` applies the update of the backwards since the last (2, 5 and 3 of them, with
gradient_accumulation_steps 4), at ZeRO stages 0-3 with SGD and momentum and clipping. Writes
``<out>.<backend>.rank<r>.pt``: per stage, ``was_step_applied()``, ``global_steps`` and ``global_samples`` after each
step, the values ``backward`` returned, ``is_gradient_accumulation_boundary()`` after each backward and step, the final (gathered) parameters, and whether
``set_gradient_accumulation_boundary`` was refused.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/deepspeed/scripts/ds_unmanaged.py --backend deepspeed --out x
"""

import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import backend, leave_together

deepspeed, args = backend()
rank = deepspeed.comm.get_rank()
BACKWARDS = (2, 5, 3)


def run(stage):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
              "managed_gradient_accumulation": False, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(1 + rank)
    out = {"applied": [], "global_steps": [], "global_samples": [], "returned": [], "boundary": []}
    for count in BACKWARDS:
        for _ in range(count):
            x, y = torch.randn(2, 6, generator=g), torch.randint(0, 4, (2,), generator=g)
            out["returned"].append(engine.backward(F.cross_entropy(engine(x), y)).item())
            out["boundary"].append(engine.is_gradient_accumulation_boundary())
        engine.step()
        out["boundary"].append(engine.is_gradient_accumulation_boundary())
        out["applied"].append(engine.was_step_applied())
        out["global_steps"].append(engine.global_steps)
        out["global_samples"].append(engine.global_samples)
    try:
        engine.set_gradient_accumulation_boundary(True)
        out["boundary_refused"] = False
    except AssertionError:
        out["boundary_refused"] = True
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        out["params"] = {k: v.detach().clone().float() for k, v in net.state_dict().items()}
    return out


torch.save({stage: run(stage) for stage in range(4)}, f"{args.out}.{args.backend}.rank{rank}.pt")
leave_together()
