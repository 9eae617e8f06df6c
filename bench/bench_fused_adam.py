"""Benchmark the CUDA kernels of dsfunc.kernels against torch and against the memory-bandwidth floor.

The fused update (``dsfunc.adam_step_``) and ``torch.optim.AdamW(fused=True)`` run on the same flat fp32
buffer, by default as many elements as the 1.3b GPT of shared/BENCH.md has parameters (1,313,722,368),
the update also with a bf16 gradient (read as it is, and widened to fp32 first as before);
``sum_of_squares`` runs over that buffer cut into that model's parameter shapes (292 tensors), against
``torch._foreach_norm`` (what clip_grad_norm_ uses).
The floor of each is the bytes it must move (each input read once, each output written once) divided
by the device-to-device copy rate measured in the same run (bytes read + written per second).

    python bench/bench_fused_adam.py [--repeat 20] [--out DIR]

Prints a table (and writes results.json under --out). Times are medians of CUDA-event timings after
warm-up; every variant is measured in two rounds, to show the run-to-run spread, and the slower round
is the one compared with the floor.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

import dsfunc.kernels as K


def time_ms(fn: Callable[[], object], repeat: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_rate(nbytes: int, repeat: int) -> float:
    """Device-to-device copy rate in bytes (read + written) per second."""
    src = torch.rand(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeat)
    return 2 * nbytes / (ms / 1e3)


def gpt_shapes(layers: int = 24, d: int = 2048, vocab: int = 50304, seq: int = 1024) -> list[tuple[int, ...]]:
    """Parameter shapes of the 1.3b GPT of shared/BENCH.md (tied embedding)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (seq, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (4 * d, d),
            (4 * d,),
            (d, 4 * d),
            (d,),
        ]
    return shapes + [(d,), (d,)]


def views(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=sum(math.prod(s) for s in gpt_shapes()))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cases", default="", help="run only the cases whose name contains this text")
    args = parser.parse_args()
    if not K.fused_adam_available("cuda"):
        raise SystemExit("the CUDA kernels of ops/ are not available here (see the logged reason)")
    n, repeat = args.numel, args.repeat
    rate = copy_rate(2 << 30, repeat)
    torch.cuda.empty_cache()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy rate {rate / 1e9:.0f} GB/s",
        flush=True,
    )

    torch.manual_seed(0)
    param = torch.randn(n, device="cuda")
    grad = torch.randn(n, device="cuda") * 1024.0
    exp_avg = torch.randn(n, device="cuda") * 1e-3
    exp_avg_sq = torch.rand(n, device="cuda") * 1e-6
    lowp = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    hyper = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    scalars = {
        "grad_scale": torch.tensor(1.0 / 1024.0, device="cuda"),
        "lr": torch.tensor(3e-4, device="cuda"),
        "step": torch.tensor(10.0, device="cuda"),
        "skip": torch.tensor(False, device="cuda"),
    }
    skipping = dict(scalars, skip=torch.tensor(True, device="cuda"))

    shared = torch.nn.Parameter(param)  # the same storage as `param`
    shared.grad = grad
    torch_adamw = torch.optim.AdamW(
        [shared], lr=3e-4, betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
        weight_decay=hyper["weight_decay"], fused=True,
    )  # fmt: skip
    grads = views(grad, gpt_shapes())
    grads_bf16 = views(lowp, gpt_shapes())
    n_norm = sum(g.numel() for g in grads)
    if n_norm > n:
        raise SystemExit(
            f"--numel must be at least {n_norm} (the sum_of_squares case cuts the buffer into the GPT)"
        )

    grad_bf16 = grad.bfloat16()  # a bf16 gradient, as one micro-batch on one rank leaves it

    def ours(lp=None, s=scalars, at=(0, 0, 0), g=grad):
        """dsfunc.adam_step_; `at` = offsets in elements of (param and moments, grad, lowp)."""
        p0, g0, l0 = at
        count = n - max(at)
        sl, sg = slice(p0, p0 + count), slice(g0, g0 + count)
        low = None if lp is None else lp[l0 : l0 + count]
        return lambda: K.adam_step_(param[sl], g[sg], exp_avg[sl], exp_avg_sq[sl], lowp=low, **s, **hyper)

    def widened_first():
        K.adam_step_(param, grad_bf16.float(), exp_avg, exp_avg_sq, lowp=lowp, **scalars, **hyper)

    def torch_norm(ts):
        return lambda: torch.isfinite(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))))

    def torch_adamw_then_cast():
        torch_adamw.step()
        lowp.copy_(param)

    gb = 1e9
    # name, fn, bytes that must move, elements
    cases = [
        ("torch.optim.AdamW(fused=True).step()", torch_adamw.step, 28 * n, n),
        ("dsfunc adam_step_ (fp32 only)", ours(), 28 * n, n),
        ("dsfunc adam_step_ + bf16 copy (fused)", ours(lowp), 30 * n, n),
        ("torch AdamW(fused) + separate bf16 cast", torch_adamw_then_cast, 30 * n, n),
        ("dsfunc, all at +1 element", ours(lowp, at=(1, 1, 1)), 30 * n, n),
        ("dsfunc, lowp at +1 element", ours(lowp, at=(0, 0, 1)), 30 * n, n),
        ("dsfunc, grad at +1 element (scalar path)", ours(lowp, at=(0, 1, 0)), 30 * n, n),
        ("dsfunc, bf16 grad read as it is + bf16 copy", ours(lowp, g=grad_bf16), 28 * n, n),
        ("dsfunc, bf16 grad widened first + bf16 copy", widened_first, 28 * n, n),
        ("dsfunc, bf16 grad at +1 element (scalar path)", ours(lowp, at=(0, 1, 0), g=grad_bf16), 28 * n, n),
        ("dsfunc adam_step_ skip=True", ours(lowp, skipping), 0, n),
        ("torch _foreach_norm + isfinite, fp32 grads", torch_norm(grads), 4 * n_norm, n_norm),
        ("dsfunc sum_of_squares, fp32 grads", lambda: K.sum_of_squares(grads), 4 * n_norm, n_norm),
        ("torch _foreach_norm + isfinite, bf16 grads", torch_norm(grads_bf16), 2 * n_norm, n_norm),
        ("dsfunc sum_of_squares, bf16 grads", lambda: K.sum_of_squares(grads_bf16), 2 * n_norm, n_norm),
    ]
    cases = [case for case in cases if args.cases in case[0]]
    rounds: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for _ in range(2):
        for name, fn, _, _ in cases:
            rounds[name].append(time_ms(fn, repeat))

    rows = []
    header = f"{'case':44s} {'ms (round 1 / 2)':>18s} {'floor ms':>9s} {'% floor':>8s} {'GB/s':>7s}"
    print(header)
    for name, _, nbytes, numel in cases:
        ms = max(rounds[name])
        floor_ms = nbytes / rate * 1e3
        row = {
            "case": name,
            "ms": rounds[name],
            "floor_ms": floor_ms,
            "pct_floor": 100 * floor_ms / ms if nbytes else None,
            "GBps": nbytes / (ms / 1e3) / gb,
            "numel": numel,
        }
        rows.append(row)
        pct = f"{row['pct_floor']:7.1f}%" if nbytes else "       -"
        r1, r2 = rounds[name]
        print(f"{name:44s} {r1:8.3f} / {r2:7.3f} {floor_ms:9.3f} {pct} {row['GBps']:7.0f}")
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numel": n,
        "copy_rate_GBps": rate / gb,
        "rows": rows,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
