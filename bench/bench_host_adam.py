"""The host Adam of ZeRO-Offload on one unit: dsfunc's CPU kernel (ops/adam_cpu.cpp, one pass) against
torch's own fused CPU Adam (``torch._fused_adamw_``), which needs the bf16 gradient widened first and the new
parameters cast to bf16 afterwards — done unit-wide (three passes through memory) or chunk by chunk while
the chunk is in cache.

    python bench/bench_host_adam.py --numel 134217728 --threads 15,16 --dtypes bfloat16,float16

A unit of ``--numel`` fp32 parameters with 16-bit gradients and a 16-bit copy written (what one rank's
offloaded AdamW does under bf16 or fp16), the best of ``--repeat`` runs per variant, in ms and in GB/s of the 28 bytes per parameter
that must move (read gradient, parameter and moments; write parameter, moments and copy).

``--bf16_states``: instead, the update of ZeRO-Offload with bf16 masters, moments and gradient sums
(``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``, AdamW, clipping on) on one unit of ``--numel``
elements, through the config's update as the host runs it: dsfunc's native bf16 kernel against the torch chain it
replaces (:mod:`dsfunc.optim.low_precision_host`), beside the fp32 kernel above; in seconds per 64M elements.

    python bench/bench_host_adam.py --bf16_states --numel 67108864 --threads 1,2 --repeat 1
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import dsfunc
from dsfunc.kernels.native import native_ready
from dsfunc.optim.host_adam import host_adam_
from dsfunc.optim.update import UpdateContext

HYPER = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def best_of(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=1 << 27)
    parser.add_argument("--threads", default=str(torch.get_num_threads()))
    parser.add_argument("--chunk", type=int, default=1 << 22)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtypes", default="bfloat16,float16", help="the gradient's and the copy's dtypes")
    parser.add_argument("--bf16_states", action="store_true", help="bf16 masters and moments: native vs torch chain")
    args = parser.parse_args()
    assert native_ready("cpu"), "dsfunc's CPU kernel did not build (see the logged reason)"
    if args.bf16_states:
        compare_bf16_states(args)
        return
    print(f"| dtype | threads | variant | ms per {args.numel / 2**20:.3g}M parameters | GB/s of 28 B/parameter |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        compare(getattr(torch, dtype), args)


def figure(x: float) -> str:
    """Three significant digits, so that a small --numel's times do not print as 0.0."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def compare(dtype: torch.dtype, args: argparse.Namespace) -> None:
    n, chunk = args.numel, args.chunk
    param, mu, nu = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad, lowp, scratch = torch.randn(n).to(dtype), torch.empty(n, dtype=dtype), torch.empty(n)
    lr, step, scale = torch.tensor(1e-3), torch.tensor(1.0), torch.tensor(1.0)

    def dsfunc_kernel() -> None:
        host_adam_([param], [grad], [mu], [nu], grad_scale=scale, lr=lr, step=step, skip=torch.tensor(False),
                   lowp=[lowp], adam_w_mode=True, **HYPER)

    def torch_fused(length: int):
        def run() -> None:
            for start in range(0, n, length):
                part = slice(start, start + length)
                torch._fused_adamw_([param[part]], [scratch[part].copy_(grad[part])], [mu[part]], [nu[part]], [],
                                    [step], lr=lr, amsgrad=False, maximize=False, **HYPER)
                lowp[part].copy_(param[part])
        return run

    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        variants = [("dsfunc CPU kernel", dsfunc_kernel), ("torch fused, three passes", torch_fused(n)),
                    (f"torch fused, chunks of {chunk}", torch_fused(chunk))]
        for name, fn in variants:
            t = best_of(fn, args.repeat)
            ms, rate = figure(1e3 * t), figure(28 * n / t / 1e9)
            print(f"| {str(dtype).removeprefix('torch.')} | {threads} | {name} | {ms} | {rate} |")


class _Now:
    """A host executor that runs the update at once."""

    on_host = True

    def run(self, names: list[str], work) -> None:
        work(names)

    def unit_done(self, name: str, master: torch.Tensor) -> None:
        """Nothing waits."""


def compare_bf16_states(args: argparse.Namespace) -> None:
    n, per = args.numel, 2**26 / args.numel
    cfg = {"train_batch_size": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    native = dsfunc.optim.update_from_config(dsfunc.Config.load(cfg))
    assert native.native is not None
    params, grads = {"u": torch.randn(n).bfloat16()}, {"u": torch.randn(n).bfloat16()}
    ctx = UpdateContext(loss_scale=torch.ones(()), grad_norm=torch.tensor(2.0), grad_scale=torch.ones(()),
                        finite=torch.tensor(True), skip=torch.tensor(False), lowp={}, segment_norm=None,
                        executor=_Now())

    def chain_update(update):
        state = update.init(params)
        return lambda: update.apply(params, grads, state, ctx)

    param, mu, nu, grad = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n).bfloat16()
    lowp, one = torch.empty(n, dtype=torch.bfloat16), torch.tensor(1.0)

    def fp32_kernel() -> None:
        host_adam_([param], [grad], [mu], [nu], grad_scale=one, lr=torch.tensor(1e-3), step=one,
                   skip=torch.tensor(False), lowp=[lowp], adam_w_mode=True, **HYPER)

    print("| threads | variant | s per 64M elements |")
    print("|---|---|---|")
    variants = [("bf16 states, dsfunc native kernel", chain_update(native)),
                ("bf16 states, torch chain", chain_update(dataclasses.replace(native, native=None))),
                ("fp32 states, dsfunc CPU kernel", fp32_kernel)]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, fn in variants:
            print(f"| {threads} | {name} | {figure(best_of(fn, args.repeat) * per)} |")


if __name__ == "__main__":
    main()
