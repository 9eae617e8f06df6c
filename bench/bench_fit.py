"""The largest micro-batch of a BENCH.md workload that trains on one GPU, with and without activation
checkpointing (bench_single.py's systems: ``dsfunc``, ``dsfunc+units``, ``plain+ckpt``, ...).

    python bench/bench_fit.py --model 1.3b --systems dsfunc,dsfunc+selective,dsfunc+units,plain,plain+ckpt

Per system, each probe in a fresh process (a CUDA out-of-memory error leaves nothing behind): two steps at
micro-batches 4 and 8 give the bytes each sample adds to the peak (activations grow linearly with it); the
largest multiple of 4 that this predicts fits is run next, then its neighbours upward until one fails; if
the prediction failed (with checkpointing the peak at small micro-batches can be the update's), bisection
between 8 and it. Prints the largest micro-batch that trained (of the preset's sequence length) and the
smallest that did not.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

import torch
from bench_single import RUNNERS  # the same systems, built and stepped the same way

from dsfunc.models.gpt import GPTConfig

STEP = 4  # micro-batch granularity of the search


def probe(model: str, system: str, micros: list[int], stop_on: bool) -> list[dict]:
    """Train two steps at each of ``micros`` in a fresh process, stopping after the first whose ``fits`` is
    ``stop_on``."""
    cmd = [sys.executable, __file__, "--probe", model, system, ",".join(map(str, micros)), str(int(stop_on))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"probe {system} {micros} printed nothing:\n{proc.stderr[-3000:]}")
    return rows


def run_probe(model: str, system: str, micros: str, stop_on: str) -> None:
    cfg = GPTConfig.preset(model)
    kind, *options = system.split("+")
    free = torch.cuda.mem_get_info()[0]
    for micro in (int(m) for m in micros.split(",")):
        gc.collect()  # the last probe's state and its module hooks
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            RUNNERS[kind](cfg, set(options), micro, 1, 1, torch.device("cuda"))
            row = {"micro": micro, "fits": True, "peak": torch.cuda.max_memory_allocated(), "free": free}
        except torch.OutOfMemoryError:
            row = {"micro": micro, "fits": False}
        print(json.dumps(row), flush=True)
        if row["fits"] == bool(int(stop_on)):
            return


def search(model: str, system: str) -> tuple[int, int | None]:
    """(largest micro-batch that trained, smallest that did not; None when none failed)."""
    small = probe(model, system, [STEP, 2 * STEP], stop_on=False)
    if not all(r["fits"] for r in small):
        return max([0] + [r["micro"] for r in small if r["fits"]]), min(r["micro"] for r in small if not r["fits"])
    per_sample = max(1, small[1]["peak"] - small[0]["peak"]) / STEP
    fixed = small[0]["peak"] - STEP * per_sample
    guess = max(3 * STEP, int((small[0]["free"] - fixed) / per_sample) // STEP * STEP)
    up = probe(model, system, [guess + k * STEP for k in range(4)], stop_on=False)
    fits = [r["micro"] for r in up if r["fits"]]
    fails = [r["micro"] for r in up if not r["fits"]]
    if fits:
        return max(fits), min(fails) if fails else None
    # The guess failed: at small micro-batches the peak can be the update's, not the activations', and the
    # slope too low. Bisect between the last that ran and the guess.
    low, high = 2 * STEP, guess
    while high - low > STEP:
        mid = (low + high) // 2 // STEP * STEP
        [row] = probe(model, system, [mid], stop_on=False)
        low, high = (mid, high) if row["fits"] else (low, mid)
    return low, high


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1.3b")
    parser.add_argument("--systems", default="dsfunc,dsfunc+units,dsfunc+selective,plain,plain+ckpt")
    parser.add_argument("--probe", nargs=4, metavar=("MODEL", "SYSTEM", "MICROS", "STOP_ON"))
    args = parser.parse_args()
    if args.probe:
        run_probe(*args.probe)
        return
    cfg = GPTConfig.preset(args.model)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"{args.model} on {torch.cuda.get_device_name()} ({total:.0f} GiB), torch {torch.__version__}, "
          f"seq {cfg.seq_len}")
    print("| system | largest micro-batch that trains | tokens per micro-batch | smallest that does not |")
    print("|---|---|---|---|")
    for system in args.systems.split(","):
        fits, fails = search(args.model, system)
        print(f"| {system} | {fits} | {fits * cfg.seq_len:,} | {fails if fails is not None else '> ' + str(fits)} |",
              flush=True)


if __name__ == "__main__":
    main()
