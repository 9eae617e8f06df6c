"""Train a small character-level GPT on the Python reference manual that ships with Python.

    python examples/gpt/train.py                       # embedded config, CPU or GPU, about a minute
    dsfunc --num_gpus 2 examples/gpt/train.py          # the same on 2 ranks (ZeRO stage from the config)
    python examples/gpt/train.py --deepspeed_config my_config.json --steps 500

No download: the text is `pydoc_data.topics`, part of the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import pydoc_data.topics
import time

import torch

import dsfunc
from dsfunc.models.gpt import GPT, GPTConfig, init_weights

CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 300, "warmup_num_steps": 30}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1},
}


def load_text() -> tuple[torch.Tensor, list[str]]:
    text = "\n".join(pydoc_data.topics.topics.values())
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars


def batches(data: torch.Tensor, batch: int, seq: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of one step on one rank: a pure function of (step, rank), so resuming is exact."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    x = torch.stack([data[s : s + seq] for s in starts])
    y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_config", help="DeepSpeed JSON config (default: the one embedded here)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher; unused")
    args = parser.parse_args()

    if "WORLD_SIZE" in os.environ:  # started by dsfunc, torchrun or mpirun
        dsfunc.init_distributed()
    config = args.deepspeed_config or CONFIG
    data, chars = load_text()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(chars), seq_len=args.seq, n_layer=2, n_head=4, d_model=64))
    model.apply(init_weights)
    state = dsfunc.init_state(model, config)
    cfg = state.program.config
    rank, per_rank = dsfunc.get_rank(), cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    if rank == 0:
        print(f"dsfunc {dsfunc.__version__}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(data):,} characters, world size {cfg.world_size}, ZeRO stage {cfg.zero_optimization.stage}, "
              f"{cfg.compute_dtype}, device {state.program.device}")
        print("config:", json.dumps(cfg.to_dict()["optimizer"]))

    first = None
    start = time.perf_counter()
    for step in range(args.steps):
        state = dsfunc.train_step(state, batches(data, per_rank, args.seq, step, rank))
        if step % 25 == 0 or step == args.steps - 1:
            m = state.metrics.to_dict()
            first = m["loss"] if first is None else first
            rate = (step + 1) * cfg.train_batch_size * args.seq / (time.perf_counter() - start)
            if rank == 0:
                print(f"step {step + 1:4d}  loss {m['loss']:.3f}  lr {m['lr']:.2e}  "
                      f"grad_norm {m['grad_norm']:.2f}  tokens/s {rate:,.0f}", flush=True)
    last = state.metrics.loss.item()
    if rank == 0:
        print(f"done: loss {first:.3f} -> {last:.3f} in {time.perf_counter() - start:.0f} s")
    if not last < first:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
