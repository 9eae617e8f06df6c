"""The host Adam of ZeRO-Offload on one unit: chunked (widen, update and cast while in cache) against the
three passes through memory it replaced (widen the unit, update it, cast it).

    python bench/bench_host_adam.py --numel 134217728 --threads 16,8

A unit of ``--numel`` fp32 parameters with bf16 gradients (what one rank's offloaded AdamW sees), the best
of ``--repeat`` runs per variant, in ms and in bytes of host traffic per second as the variant moves them.
"""

from __future__ import annotations

import argparse
import time

import torch

from dsfunc.optim.host_adam import host_adam_

HYPER = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "adam_w_mode": True}


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
    parser.add_argument("--chunks", default=f"{1 << 20},{1 << 22}")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = args.numel
    param, mu, nu = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad, lowp, scratch = torch.randn(n).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16), torch.empty(n)
    scalars = {"grad_divisor": torch.tensor(1.0), "lr": torch.tensor(1e-3), "step": torch.tensor(1.0),
               "skip": torch.tensor(False)}

    def three_passes() -> None:
        host_adam_([param], [grad], [mu], [nu], widen=lambda g: scratch[: g.numel()].copy_(g), chunk=n,
                   **scalars, **HYPER)
        lowp.copy_(param)

    def chunked(chunk: int):
        buf = torch.empty(chunk)
        return lambda: host_adam_([param], [grad], [mu], [nu], widen=lambda g: buf[: g.numel()].copy_(g),
                                  lowp=[lowp], chunk=chunk, **scalars, **HYPER)

    print(f"| threads | variant | ms per {n / 2**20:.0f}M parameters | GB/s moved |")
    print("|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        variants = [("three passes", three_passes, 40)]
        variants += [(f"chunks of {c}", chunked(c), 28) for c in (int(c) for c in args.chunks.split(","))]
        for name, fn, moved in variants:  # bytes per parameter read and written
            t = best_of(fn, args.repeat)
            print(f"| {threads} | {name} | {1e3 * t:.1f} | {moved * n / t / 1e9:.0f} |")


if __name__ == "__main__":
    main()
