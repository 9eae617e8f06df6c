"""Where the eager step's host time goes: cProfile of dsfunc.train_step on bench_step_overhead's tiny MLP.

    python bench/profile_step.py [--device cpu|cuda] [--steps 300] [--top 25]

Prints the milliseconds per step of the step's parts (forward with binding, backward, update), the functions
with the most time of their own, and the device kernels one step launches against the plain loop's
(bench_step_overhead's, with fused AdamW on CUDA): on a GPU each launch is host time. For the step's host
overhead against the plain loop see bench_step_overhead.py; this says where it is.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats

import torch
from bench_step_overhead import Tiny, plain_step
from torch.profiler import ProfilerActivity, profile

import dsfunc

PARTS = {  # label -> (file suffix, function name) of the step's parts
    "forward (binding, the model)": ("dsfunc/zero/runtime.py", "forward"),
    "backward (autograd, gradient hooks)": ("dsfunc/zero/runtime.py", "backward"),
    "update (norm, optimizer, scaler, metrics)": ("dsfunc/step.py", "apply_gradients"),
    "whole step": ("dsfunc/step.py", "_run_step"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    batch = (torch.randn(8, 32, device=device), torch.randint(0, 10, (8,), device=device))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    states = [dsfunc.init_state(Tiny(), config, device=device)]

    def dsfunc_step() -> None:
        states[0] = dsfunc.train_step(states[0], batch)

    stats = profiled(dsfunc_step, args.steps, device)
    print(f"device {device}, torch {torch.__version__}, {args.steps} steps under cProfile (which slows Python)")
    for label, (path, name) in PARTS.items():
        print(f"  {label:45s} {cumulative(stats, path, name) / args.steps * 1e3:7.3f} ms/step")
    step = plain_step(Tiny(), device)
    plain_stats = profiled(lambda: step(batch), args.steps, device)
    backward = cumulative(plain_stats, "torch/autograd/__init__.py", "backward")
    print(f"  plain loop: backward {backward / args.steps * 1e3:.3f} ms/step, "
          f"whole step {plain_stats.total_tt / args.steps * 1e3:.3f} ms/step")
    stats.sort_stats("tottime").print_stats(args.top)
    if device.type == "cuda":
        print_kernels("dsfunc step", kernels(dsfunc_step))
        print_kernels("plain loop", kernels(lambda: step(batch)))


def profiled(run, steps: int, device: torch.device) -> pstats.Stats:
    """cProfile of ``steps`` calls of ``run()`` after 20 unprofiled ones (on CUDA, until the device is done)."""
    for _ in range(20):
        run()
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        run()
    sync()
    profiler.disable()
    return pstats.Stats(profiler)


def cumulative(stats: pstats.Stats, path: str, name: str) -> float:
    """Seconds spent inside the function ``name`` of the file ending in ``path``."""
    return sum(v[3] for (file, _, fn), v in stats.stats.items() if file.endswith(path) and fn == name)


def kernels(run) -> collections.Counter:
    """The device kernels ``run()`` launches, by name."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")


def print_kernels(label: str, counts: collections.Counter) -> None:
    print(f"{label}: {sum(counts.values())} kernels")
    for name, n in counts.most_common():
        print(f"  {n:3d}  {name[:110]}")


if __name__ == "__main__":
    main()
