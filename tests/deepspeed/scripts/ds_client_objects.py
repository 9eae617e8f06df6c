"""One engine-API script for real DeepSpeed and for dsfunc (``--backend``) with client objects: a custom
``torch.optim.Optimizer`` subclass (and torch optimizers dsfunc cannot translate) with a client lr scheduler, an
empty param group, ZeRO stages 0-3, gradient accumulation and clipping; and the config's optimizer with a client
scheduler (a callable's, or one built on another optimizer). Writes ``<out>.<backend>.rank<r>.pt`` with
what ``initialize`` returned, ``was_step_applied()`` and ``get_lr()`` after every ``step()``, and the final
(gathered) parameters.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/deepspeed/scripts/ds_client_objects.py --backend deepspeed --out x
"""

import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import backend, leave_together

deepspeed, args = backend()
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
MICRO, GAS, STEPS = 2, 2, 4


class HeavyBall(torch.optim.Optimizer):
    """A client's own optimizer: momentum SGD with a decaying step, its state a tensor per parameter."""

    def __init__(self, params, lr=0.1, momentum=0.8):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = p.grad.clone()
                else:
                    state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


OPTIMIZERS = {
    "heavyball": lambda groups: HeavyBall(groups, lr=0.05),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.01, momentum=0.5),
    "amsgrad": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
}


def train(stage, kind):
    torch.manual_seed(0)
    net = Net()
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    opt = OPTIMIZERS[kind]([{"params": decay}, {"params": [], "lr": 0.5}, {"params": rest, "lr": 0.02}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, optimizer, _, scheduler = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=sched,
                                                           config=config)
    out = {"optimizer_is_client": optimizer is opt, "wraps_client": getattr(optimizer, "optimizer", None) is opt,
           "scheduler_is_client": scheduler is sched, "engine_scheduler_is_client": engine.lr_scheduler is sched,
           "groups": len(opt.param_groups), "applied": [], "lr": []}
    for _ in micro_steps(engine):
        out["applied"].append(engine.was_step_applied())
        out["lr"].append(engine.get_lr())
    out["params"] = gathered(net)
    return out


def micro_steps(engine):
    """STEPS steps of GAS micro-batches each (this rank's part of seeded global batches): yields after each
    ``engine.step()``, whether it ended the accumulation."""
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x = torch.randn(world * MICRO * GAS, 6, generator=g)
        y = torch.randint(0, 4, (world * MICRO * GAS,), generator=g)
        mine = slice(rank * MICRO * GAS, (rank + 1) * MICRO * GAS)
        for i in range(GAS):
            part = slice(i * MICRO, (i + 1) * MICRO)
            engine.backward(F.cross_entropy(engine(x[mine][part]), y[mine][part]))
            engine.step()
            yield i == GAS - 1


def gathered(net) -> dict:
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        return {k: v.detach().clone().float() for k, v in net.state_dict().items()}


def config_optimizer(stage, kind):
    """The config's optimizer with a client scheduler: one a callable builds on the engine's optimizer (DeepSpeed
    returns it and steps it: it drives the lr), or one built on another optimizer (returned and stepped, the lr
    stays the config's)."""
    torch.manual_seed(0)
    net = Net()
    section = {"adam": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
               "sgd": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}[kind]
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "optimizer": section,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}  # SGD under ZeRO
    if kind == "adam":
        sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    else:
        sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(Net().parameters(), lr=0.3), step_size=1, gamma=0.5)
    engine, _, _, scheduler = deepspeed.initialize(model=net, model_parameters=net.parameters(), lr_scheduler=sched,
                                                   config=config)
    out = {"scheduler_class": type(scheduler).__name__, "engine_scheduler": engine.lr_scheduler is scheduler,
           "scheduler_is_client": scheduler is sched, "lr": [], "scheduler_lr": []}
    for last in micro_steps(engine):
        if last:
            out["lr"].append(engine.get_lr())
            out["scheduler_lr"].append(scheduler.get_last_lr())
    out["params"] = gathered(net)
    return out


def untested_refused():
    """Which client optimizers DeepSpeed refuses, by ZeRO stage: those it has not tested with ZeRO (torch's SGD, a
    class of the client's own; not Adam), unless ``zero_allow_untested_optimizer``."""
    out = {}
    cases = [(stage, "sgd", False) for stage in range(4)] + [(1, "heavyball", False), (3, "adam", False), (2, "sgd", True)]
    for stage, kind, allow in cases:
        net = Net()
        make = {"sgd": torch.optim.SGD, "heavyball": HeavyBall, "adam": torch.optim.Adam}[kind]
        config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage}}
        if allow:
            config["zero_allow_untested_optimizer"] = 1
        try:
            deepspeed.initialize(model=net, optimizer=make(net.parameters(), lr=0.1), config=config)
            out[stage, kind, allow] = "accepted"
        except AssertionError:
            out[stage, kind, allow] = "refused"
    return out


results = {(stage, kind): train(stage, kind) for stage in range(4) for kind in ("heavyball",)}
results.update({(stage, kind): train(stage, kind) for stage in (0, 2) for kind in ("rmsprop", "amsgrad")})
results["untested_refused"] = untested_refused()
results["config_optimizer"] = {(stage, kind): config_optimizer(stage, kind) for stage in (0, 1) for kind in ("adam", "sgd")}
torch.save(results, f"{args.out}.{args.backend}.rank{rank}.pt")
leave_together()
