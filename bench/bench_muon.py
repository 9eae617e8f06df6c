"""Muon's orthogonalisation of a GPT's hidden matrices: one call per matrix against stacked calls, one per shape.

    python bench/bench_muon.py --device cuda                      # BENCH.md's 1.3b: 24 blocks, d 2048
    python bench/bench_muon.py --device cpu --layers 4 --d 256    # a CPU stand-in

The matrices Muon updates in BENCH.md's GPT (each block's c_attn [3d, d], c_proj [d, d], fc [4d, d], proj [d, 4d];
the embeddings take Adam), random, fp32 as Muon's blended momentum. ``per matrix`` runs
:func:`dsfunc.optim.muon.orthogonalize` on each (DeepSpeed's way, and dsfunc's before stacking); ``stacked`` runs
:func:`dsfunc.optim.muon.orthogonalize_all` (the matrices of one shape in one call, at most ``MAX_BATCH_ELEMENTS``
elements a call), ``stacked, no cap`` with every matrix of a shape in one call. Newton-Schulz as ``--method``
(DeepSpeed's default ``gram``: fp16 where the device has it), compiled where ``--compiled`` says (by default on
a GPU, as a training step runs it). Each variant is warmed up (the compiles) and then timed ``--repeat`` times, in
``--rounds`` interleaved rounds; a row gives the median milliseconds of one direction over every matrix, the calls
it makes, the peak memory it allocated beyond its inputs (CUDA), and its largest difference from ``per matrix``
relative to the largest entry (0 eager on the CPU; compiled, the stacked iteration rounds otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dsfunc.optim.muon import MAX_BATCH_ELEMENTS, orthogonalize, orthogonalize_all, stacks


def gpt_matrices(layers: int, d: int, device: torch.device) -> list[torch.Tensor]:
    """Every Muon matrix of BENCH.md's GPT with ``layers`` blocks of width ``d``, block by block."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers
    return [torch.randn(shape, generator=g, device=device) for shape in shapes]


def timed(fn: Callable[[], list[torch.Tensor]], device: torch.device, repeat: int) -> tuple[float, float]:
    """Median milliseconds of ``fn`` (synchronised) and the peak bytes it allocated beyond what was live (CUDA)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times = []
    if device.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats(device)
    live = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) - live if device.type == "cuda" else 0
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--method", default="gram", choices=["gram", "standard"])
    parser.add_argument("--compiled", default="auto", choices=["auto", "yes", "no"])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    compiled = {"auto": None, "yes": True, "no": False}[args.compiled]
    # both variants' shapes compile in this one process (7 graphs at 1.3b, near dynamo's 8, past which it would
    # run eagerly); a training step compiles only the stacked ones
    torch._dynamo.config.recompile_limit = 64
    us = gpt_matrices(args.layers, args.d, device)

    def per_matrix() -> list[torch.Tensor]:
        return [orthogonalize(u, method=args.method, compiled=compiled) for u in us]

    def stacked(cap: int) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            out = dict(orthogonalize_all(us, method=args.method, compiled=compiled, max_elements=cap))
            return [out[i] for i in range(len(us))]
        return run

    variants = {"per matrix": (per_matrix, len(us)), "stacked": (stacked(MAX_BATCH_ELEMENTS), len(stacks(us))),
                "stacked, no cap": (stacked(2**62), len(stacks(us, 2**62)))}
    reference = per_matrix()
    top = max(r.abs().max().item() for r in reference)
    differences = {}
    for name, (fn, _) in variants.items():
        for _ in range(args.warmup):
            out = fn()
        differences[name] = max((a - b).abs().max().item() for a, b in zip(out, reference)) / top
        del out
    print(f"{len(us)} matrices ({args.layers} blocks, d {args.d}) on {device}, {args.method}, compiled "
          f"{args.compiled}, torch {torch.__version__}")
    print("| round | variant | ms a direction | calls | peak MiB beyond inputs | max diff / max entry |")
    print("|---|---|---|---|---|---|")
    for round in range(1, args.rounds + 1):
        for name, (fn, calls) in variants.items():
            ms, peak = timed(fn, device, args.repeat)
            print(f"| {round} | {name} | {ms:.2f} | {calls} | {peak / 2**20:,.0f} | {differences[name]:.2e} |",
                  flush=True)


if __name__ == "__main__":
    main()
