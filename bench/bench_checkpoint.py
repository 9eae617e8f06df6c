"""What checkpointing costs the training loop: no saves, synchronous saves, asynchronous saves.

    python bench/bench_checkpoint.py [--device cpu|cuda] [--steps 60] [--every 10] [--rounds 2]

Trains a small GPT (dsfunc.models.gpt) on one process and saves a checkpoint every ``--every`` steps.
For each mode it prints the wall and CPU time per step averaged over the whole run (saves included),
the time the save call blocks the loop, and the median step time with and without an asynchronous
save being written meanwhile. The overhead per step is the difference to the run without saves; the
modes are interleaved over ``--rounds`` so that drifting machine load affects them alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import dsfunc
from dsfunc import checkpoint
from dsfunc.models.gpt import GPT, GPTConfig, init_weights

MODEL = GPTConfig(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(mode: str, steps: int, every: int, device: torch.device, root: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(MODEL)
    model.apply(init_weights)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
    }
    state = dsfunc.init_state(model, config, device=device)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, MODEL.vocab_size, (8, MODEL.seq_len + 1), generator=g)
    batch = (batch[:, :-1].contiguous().to(device), batch[:, 1:].contiguous().to(device))
    for _ in range(3):  # warm-up
        state = dsfunc.train_step(state, batch)
    checkpoint.save_checkpoint(state, root, tag="warmup")  # first DCP use: imports, planning caches
    blocking, during, steady = [], [], []
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(steps):
        if mode != "none" and i % every == 0:
            t = time.perf_counter()
            checkpoint.save_checkpoint(state, root, tag=f"step{i}", async_save=mode == "async")
            sync(device)
            blocking.append(time.perf_counter() - t)
        pending = checkpoint._PENDING
        writing = pending is not None and not pending.done()
        t = time.perf_counter()
        state = dsfunc.train_step(state, batch)
        float(state.metrics.loss)  # what a logging loop does; waits for the step
        (during if writing else steady).append(time.perf_counter() - t)
    checkpoint.wait_for_checkpoint()
    total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "wall ms/step": total / steps * 1e3,
        "cpu ms/step": cpu / steps * 1e3,
        "save call blocks ms": statistics.mean(blocking) * 1e3 if blocking else 0.0,
        "median step ms, no save writing": statistics.median(steady) * 1e3 if steady else float("nan"),
        "median step ms, async save writing": statistics.median(during) * 1e3 if during else float("nan"),
        "steps that overlapped a save": len(during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temporary dir)")
    args = parser.parse_args()
    device = torch.device(args.device)
    n = sum(p.numel() for p in GPT(MODEL).parameters())
    print(f"model: GPT {MODEL}; {n / 1e6:.2f}M parameters; checkpoint ~{3 * 4 * n / 2**20:.0f} MiB "
          f"(fp32 params + 2 Adam moments); device {device}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    print(f"{args.steps} steps, a save every {args.every} steps")
    results: dict[str, list[dict[str, float]]] = {"none": [], "sync": [], "async": []}
    for _ in range(args.rounds):
        for mode, rounds in results.items():
            root = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
            try:
                rounds.append(run(mode, args.steps, args.every, device, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    for key in ("wall ms/step", "cpu ms/step"):
        base = statistics.median(r[key] for r in results["none"])
        for mode, rounds in results.items():
            extra = statistics.median(r[key] for r in rounds) - base
            print(f"{mode:5s} {key} overhead vs none: {extra:8.1f} ({extra / base:+.1%})")
    for mode, rounds in results.items():
        for key in rounds[0]:
            print(f"{mode:5s} {key:36s} " + "  ".join(f"{r[key]:8.1f}" for r in rounds))


if __name__ == "__main__":
    main()
