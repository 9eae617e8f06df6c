"""The eager step's device work beyond the model's own: each op is a kernel launch on a GPU, and on a small model
the launches are the step's time (bench/RESULTS.md: the tiny MLP's step time follows its kernel count)."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsfunc
from bench.bench_step_overhead import Tiny  # the benchmark's model, whose eager step it times on the GPU

# ops that launch nothing: views, metadata, allocations, and reads of host scalars
FREE = {"empty", "view", "_unsafe_view", "t", "detach", "split_with_sizes", "select", "alias", "as_strided", "expand",
        "_local_scalar_dense", "lift_fresh", "reshape", "unsqueeze", "squeeze", "slice"}
# what the step may add to the model's forward and backward: one gradient assembly (cat) for the small units, one
# norm, one op for the step's scalars (flags, norm, clip factor), one fused Adam call, the counters, lr and metrics
ALLOWED_EXTRA = 13  # 35 before the cuts of 2026-12-03, 27 before the parameters became the leaves, 20 before step_scalars


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        name = "backward's seed" if name in ("ones_like", "full_like") else name
        if name not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_the_eager_step_launches_few_ops_beyond_the_models_own():
    torch.manual_seed(0)
    model, batch = Tiny(), (torch.randn(64, 32), torch.randint(0, 10, (64,)))
    config = {"train_micro_batch_size_per_gpu": 64, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    state = dsfunc.init_state(model, config)
    device = state.program.device  # the batch already there: its copy to the device is the loader's work
    batch = tuple(t.to(device) for t in batch)
    for _ in range(2):
        state = dsfunc.train_step(state, batch)
    with Count() as step:
        state = dsfunc.train_step(state, batch)
    plain = Tiny().to(device)
    with Count() as model_only:
        plain(*batch).backward()
    extra = step.ops - model_only.ops
    assert not (model_only.ops - step.ops), model_only.ops - step.ops  # the model's own work, none of it doubled
    assert extra["cat"] == 1 and extra["adam_steps_"] == 1, extra
    assert extra.total() <= ALLOWED_EXTRA, f"{extra.total()} ops beyond the model's: {dict(extra)}"
