"""The output projection and the loss of the BENCH.md GPT alone: forward + backward of ``hidden @ weight.T`` and
the mean cross-entropy, bf16, plain PyTorch eager, ``torch.compile``d, and ``dsfunc.kernels.linear_cross_entropy``.

    python bench/bench_cross_entropy.py [--device cuda] [--shapes 8192x768,8192x2048] [--repeat 20] [--chunks 2048,8192]

One row per shape (tokens x width, vocab 50304) and variant: median milliseconds of CUDA-event timings after
warm-up, and the peak memory allocated above the inputs (``--device cpu`` is a smoke run, timed on the host).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dsfunc.kernels import linear_cross_entropy


def plain(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def variants(chunks: list[int]) -> dict:
    """The baselines, dsfunc's op at its default chunk, and at each of ``chunks`` rows."""
    out = {"eager": plain, "compile": torch.compile(plain), "dsfunc": linear_cross_entropy}
    for rows in chunks:
        out[f"dsfunc, chunks of {rows}"] = lambda h, w, t, rows=rows: linear_cross_entropy(h, w, t, chunk_rows=rows)
    return out


def measure(fn, h, w, t, repeat: int, device: torch.device) -> tuple[float, float]:
    def once():
        h.grad = w.grad = None
        fn(h, w, t).backward()

    for _ in range(3):
        once()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = 0.0
    if device.type == "cuda":
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        once()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="8192x768,8192x2048")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--chunks", default="", help="comma-separated chunk sizes (rows) to time besides the default")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"vocab {args.vocab}, bf16")
    print("| tokens x d | variant | ms (fwd+bwd) | peak GiB above inputs | loss |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, d = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(n, d, device=device, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(args.vocab, d, device=device, generator=g) * 0.02).bfloat16().requires_grad_()
        t = torch.randint(0, args.vocab, (n,), device=device, generator=g)
        for name, fn in variants([int(c) for c in args.chunks.split(",") if c]).items():
            ms, peak = measure(fn, h, w, t, args.repeat, device)
            with torch.no_grad():
                loss = float(fn(h, w, t))
            print(f"| {shape} | {name} | {ms:.3f} | {peak:.2f} | {loss:.4f} |", flush=True)


if __name__ == "__main__":
    main()
