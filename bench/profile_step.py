"""Where the eager step's host time goes: cProfile of dsfunc.train_step on bench_step_overhead's tiny MLP.

    python bench/profile_step.py [--device cpu|cuda] [--steps 300] [--top 25] [--timers 2000]

Prints the milliseconds per step of the step's parts (forward with binding, backward, update), the functions
with the most time of their own, and the device kernels one step launches against the plain loop's
(bench_step_overhead's, with fused AdamW on CUDA): on a GPU each launch is host time. ``--timers N`` first
times the same parts over N steps with plain host timers instead (no cProfile, no sync inside a step), for
dsfunc and for the plain loop. For the step's host overhead against the plain loop see bench_step_overhead.py;
this says where it is.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import time

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
    parser.add_argument("--timers", type=int, default=0, help="steps to time each part of with host timers first")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    batch = (torch.randn(8, 32, device=device), torch.randint(0, 10, (8,), device=device))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    if args.timers:
        print_timers(Tiny(), config, batch, args.timers, device)
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


class Timers:
    """Host seconds spent inside named functions, summed over calls (the outermost call of each)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
        return timed

    @contextlib.contextmanager
    def patched(self, owner, name: str, label: str):
        """``owner.name`` timed under ``label`` inside the block."""
        original = getattr(owner, name)
        setattr(owner, name, self.wrap(label, original))
        try:
            yield
        finally:
            setattr(owner, name, original)


def print_timers(model, config, batch, steps: int, device: torch.device) -> None:
    """Microseconds a step in each part of a dsfunc step and of the plain loop, by host timers over ``steps``
    steps after 50 untimed ones (the device synchronised only around them)."""
    import dsfunc.step as step_module
    from dsfunc.zero.runtime import MicroBatchRuntime

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    state = [dsfunc.init_state(model, config, device=device)]
    timers = Timers()
    parts = [(MicroBatchRuntime, "forward", "forward (binding, the model)"),
             (MicroBatchRuntime, "backward", "backward (autograd, collecting)"),
             (step_module, "apply_gradients", "update (norm, optimizer, scaler, metrics)")]
    with contextlib.ExitStack() as stack:
        for owner, name, label in parts:
            stack.enter_context(timers.patched(owner, name, label))
        step = timers.wrap("whole step", lambda: state.__setitem__(0, dsfunc.train_step(state[0], batch)))
        mine = _timed(step, timers, steps, sync)
    opt = torch.optim.AdamW(model.to(device).parameters(), lr=1e-3, weight_decay=0.01, fused=device.type == "cuda")
    plain_timers = Timers()
    forward = plain_timers.wrap("forward", lambda: model(*batch))
    backward = plain_timers.wrap("backward", lambda loss: loss.backward())
    clip = plain_timers.wrap("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    adam = plain_timers.wrap("AdamW step, zero_grad", lambda: (opt.step(), opt.zero_grad(set_to_none=True)))

    def plain() -> None:
        backward(forward())
        clip()
        adam()

    theirs = _timed(plain_timers.wrap("whole step", plain), plain_timers, steps, sync)
    print(f"host timers over {steps} steps, µs/step (no sync inside a step):")
    for label, seconds in mine.items():
        print(f"  dsfunc  {label:45s} {seconds / steps * 1e6:8.1f}")
    for label, seconds in theirs.items():
        print(f"  plain   {label:45s} {seconds / steps * 1e6:8.1f}")


def _timed(run, timers: Timers, steps: int, sync) -> collections.Counter[str]:
    for _ in range(50):
        run()
    sync()
    timers.seconds.clear()
    for _ in range(steps):
        run()
    sync()
    return timers.seconds


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
