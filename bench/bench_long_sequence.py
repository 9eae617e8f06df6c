"""The longest sequence a BENCH.md GPT trains on one GPU at micro-batch 1 (bench_single.py's systems), with and
without the MLP tiled over the sequence:

    python bench/bench_long_sequence.py --model 1.3b --systems dsfunc+zero3+units+cpu+fused,dsfunc+zero3+units+cpu+fused+tiled

Per system, each probe trains two steps in a fresh process (an out-of-memory error leaves nothing behind): the
sequence doubles from ``--start`` until a length fails, then bisection to ``--granularity`` tokens. Prints the
longest that trained, the shortest that did not, and the peak memory and tokens/s of the longest. Attention is
SDPA's causal kernel (flash on the GPU: no sequence-squared tensor); the learned position embedding grows
with the sequence, as BENCH.md's model has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import time

import torch
from bench_single import RUNNERS  # the same systems, built and stepped the same way

from dsfunc.models.gpt import GPTConfig


def probe(model: str, system: str, seq: int) -> dict:
    cmd = [sys.executable, __file__, "--probe", model, system, str(seq)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        return {"seq": seq, "fits": False, "error": proc.stderr.strip().splitlines()[-1:]}
    return rows[0]


def run_probe(model: str, system: str, seq: int) -> None:
    cfg = dataclasses.replace(GPTConfig.preset(model), seq_len=seq)
    kind, *options = system.split("+")
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    try:
        start = time.perf_counter()
        elapsed, _, _ = RUNNERS[kind](cfg, set(options), 1, 1, 1, torch.device("cuda"))
        row = {"seq": seq, "fits": True, "peak": torch.cuda.max_memory_allocated(), "tokens_per_s": seq / elapsed,
               "wall": time.perf_counter() - start}
    except torch.OutOfMemoryError:
        row = {"seq": seq, "fits": False}
    print(json.dumps(row), flush=True)


def search(model: str, system: str, start: int, granularity: int) -> tuple[dict | None, int | None]:
    """(the longest probe that trained, the shortest length that did not)."""
    best, seq = None, start
    while True:
        row = probe(model, system, seq)
        print(f"  {system} seq {seq:,}: {'fits' if row['fits'] else 'fails'}", file=sys.stderr, flush=True)
        if not row["fits"]:
            break
        best, seq = row, seq * 2
    low, high = (best["seq"] if best else 0), seq
    while high - low > granularity:
        mid = (low + high) // 2 // granularity * granularity
        row = probe(model, system, mid)
        print(f"  {system} seq {mid:,}: {'fits' if row['fits'] else 'fails'}", file=sys.stderr, flush=True)
        if row["fits"]:
            best, low = row, mid
        else:
            high = mid
    return best, high


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1.3b")
    parser.add_argument("--systems", default="dsfunc+zero3+units+cpu+fused,dsfunc+zero3+units+cpu+fused+tiled")
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--granularity", type=int, default=8192)
    parser.add_argument("--probe", nargs=3, metavar=("MODEL", "SYSTEM", "SEQ"))
    args = parser.parse_args()
    if args.probe:
        run_probe(args.probe[0], args.probe[1], int(args.probe[2]))
        return
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"{args.model} on {torch.cuda.get_device_name()} ({total:.0f} GiB), torch {torch.__version__}, micro 1")
    print("| system | longest sequence that trains | peak GiB there | tokens/s there | shortest that does not |")
    print("|---|---|---|---|---|")
    for system in args.systems.split(","):
        best, fails = search(args.model, system, args.start, args.granularity)
        if best is None:
            print(f"| {system} | none from {args.start:,} | | | {fails:,} |", flush=True)
            continue
        print(f"| {system} | {best['seq']:,} | {best['peak'] / 2**30:.1f} | {best['tokens_per_s']:,.0f} | "
              f"{fails:,} |", flush=True)


if __name__ == "__main__":
    main()
