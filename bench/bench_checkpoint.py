"""What checkpointing costs the training loop: synchronous and asynchronous saves against none.

    python bench/bench_checkpoint.py [--device cpu|cuda] [--every 10] [--cycles 6] [--threads N]

Trains a small GPT (dsfunc.models.gpt) on one process. Each cycle runs three windows of ``--every``
steps back to back: one that starts with a synchronous save, one that starts with an asynchronous save
(waited for at the window's end, normally already done), and one without a save. The cost of a save is
its window's time minus the save-free window of the same cycle, so load that drifts over the run
(a shared machine) affects both sides alike; the figures are medians over the cycles. Also printed:
how long each save call blocks the loop, and the median step time while an async save is written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dsfunc
from dsfunc import checkpoint
from dsfunc.models.gpt import GPT, GPTConfig, init_weights

MODEL = GPTConfig(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256)
MODES = ("sync", "async", "none")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--every", type=int, default=10, help="steps per window (a save every N steps)")
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads for training")
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temporary dir)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    root = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")

    torch.manual_seed(0)
    model = GPT(MODEL)
    model.apply(init_weights)
    n = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
    }
    state = dsfunc.init_state(model, config, device=device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.seq_len + 1), generator=g)
    batch = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))
    for _ in range(3):
        state = dsfunc.train_step(state, batch)
    checkpoint.save_checkpoint(state, root, tag="warmup")  # first use: imports and caches
    size = sum(f.stat().st_size for f in (Path(root) / "warmup").iterdir())

    window: dict[str, list[float]] = {m: [] for m in MODES}
    blocks: dict[str, list[float]] = {m: [] for m in MODES}
    steps_writing, steps_idle = [], []
    try:
        for cycle in range(args.cycles):
            for mode in MODES:
                sync(device)
                start = time.perf_counter()
                if mode != "none":
                    checkpoint.save_checkpoint(state, root, tag=f"c{cycle}{mode}", async_save=mode == "async")
                    sync(device)
                    blocks[mode].append(time.perf_counter() - start)
                for _ in range(args.every):
                    save = checkpoint.api._IN_FLIGHT
                    writing = save is not None and not save.done()
                    t = time.perf_counter()
                    state = dsfunc.train_step(state, batch)
                    float(state.metrics.loss)  # what a logging loop does; waits for the step
                    (steps_writing if writing else steps_idle).append(time.perf_counter() - t)
                checkpoint.wait_for_checkpoint()
                window[mode].append(time.perf_counter() - start)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"model: GPT {MODEL}, {n / 1e6:.2f}M parameters; checkpoint {size / 2**20:.1f} MiB (fp32 params, "
          f"Adam moments); device {device}; torch {torch.__version__}; {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} training threads; {args.cycles} cycles of 3 x {args.every} steps")
    base = statistics.median(window["none"]) / args.every
    print(f"step time without saves (median window / {args.every}): {base * 1e3:.1f} ms")
    for mode in ("sync", "async"):
        extra = statistics.median(w - b for w, b in zip(window[mode], window["none"]))
        per_step = extra / args.every
        print(f"{mode:5s} save: costs {extra * 1e3:7.1f} ms per save = {per_step * 1e3:6.1f} ms/step "
              f"({per_step / base:+.1%}) with a save every {args.every} steps; "
              f"the call blocks {statistics.median(blocks[mode]) * 1e3:.1f} ms")
    if steps_writing:
        print(f"median step: {statistics.median(steps_idle) * 1e3:.1f} ms, while an async save is written "
              f"{statistics.median(steps_writing) * 1e3:.1f} ms ({len(steps_writing)} such steps)")


if __name__ == "__main__":
    main()
