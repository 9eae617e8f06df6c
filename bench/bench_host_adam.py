"""The host Adam of ZeRO-Offload on one unit: dsfunc's CPU kernel (ops/adam_cpu.cpp, one pass) against
torch's own fused CPU Adam (``torch._fused_adamw_``), which needs the bf16 gradient widened first and the new
parameters cast to bf16 afterwards — done unit-wide (three passes through memory) or chunk by chunk while
the chunk is in cache.

    python bench/bench_host_adam.py --numel 134217728 --threads 15,16 --dtypes bfloat16,float16

A unit of ``--numel`` fp32 parameters with 16-bit gradients and a 16-bit copy written (what one rank's
offloaded AdamW does under bf16 or fp16), the best of ``--repeat`` runs per variant, in ms and in GB/s of the 28 bytes per parameter
that must move (read gradient, parameter and moments; write parameter, moments and copy).
"""

from __future__ import annotations

import argparse
import time

import torch

from dsfunc.kernels.native import native_ready
from dsfunc.optim.host_adam import host_adam_

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
    args = parser.parse_args()
    assert native_ready("cpu"), "dsfunc's CPU kernel did not build (see the logged reason)"
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


if __name__ == "__main__":
    main()
