"""Train a small character-level GPT on the Python reference manual that ships with Python.

    python examples/gpt/train.py                       # embedded config, CPU or GPU, about a minute
    python examples/gpt/train.py --resume --steps 600  # continue from out-gpt/ckpt until step 600
    dsfunc --num_gpus 2 examples/gpt/train.py          # the same on 2 ranks (ZeRO stage from the config)
    python examples/gpt/train.py --deepspeed_config my_config.json --steps 500

No download: the text is `pydoc_data.topics`, part of the standard library; its last 10% is held out for
the validation loss. Every --eval_interval steps and at the end it prints the validation loss and saves a
checkpoint to OUT_DIR/ckpt; at the end it writes a generated sample to OUT_DIR/sample.txt.

--steps is the run's total number of optimizer steps (nanoGPT's max_iters), with or without --resume, and
the LR schedule's total_num_steps follows it. --resume continues from the checkpoint's step until step
--steps: with the same --steps, a run that stopped part-way ends exactly as one that did not; a larger
--steps extends the run, its LR then following the longer schedule from the saved step on.
"""

from __future__ import annotations

import argparse
import copy
import json
import pydoc_data.topics
import time
from pathlib import Path

import torch

import dsfunc
from dsfunc.models import GPT, GPTConfig, init_weights

CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 300, "warmup_num_steps": 30}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1},
    "steps_per_print": None,  # this script prints its own progress
}
VAL_BATCHES = 8


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


@torch.no_grad()
def val_loss(model: GPT, state: dsfunc.TrainState, val: torch.Tensor, seq: int) -> float:
    """The mean loss of the trained weights on fixed held-out batches (every rank must call it)."""
    model.load_state_dict(dsfunc.full_params(state))  # gathers the shards: a collective
    model.eval()
    device = state.program.device
    losses = [model(x.to(device), y.to(device)).item()
              for x, y in (batches(val, 16, seq, -1 - i, 0) for i in range(VAL_BATCHES))]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model: GPT, chars: list[str], prompt: str, length: int, temperature: float = 0.8) -> str:
    """Sample ``length`` characters after ``prompt`` from the model (call after :func:`val_loss`)."""
    model.eval()
    index = {c: i for i, c in enumerate(chars)}
    device = next(model.parameters()).device
    idx = torch.tensor([[index[c] for c in prompt]], device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for _ in range(length):
        logits = model(idx[:, -model.cfg.seq_len :])[:, -1, :] / temperature
        idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1, generator=g)], dim=1)
    return "".join(chars[i] for i in idx[0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_config", help="DeepSpeed JSON config (default: the one embedded here)")
    parser.add_argument("--steps", type=int, default=300,
                        help="train until this optimizer step (the total, also when resuming; the schedule's length)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--eval_interval", type=int, default=100, help="validation loss and checkpoint every N steps")
    parser.add_argument("--out_dir", default="out-gpt", help="where the checkpoint and the sample go")
    parser.add_argument("--resume", action="store_true", help="continue from OUT_DIR/ckpt until step --steps")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher; unused")
    args = parser.parse_args()

    data, chars = load_text()
    split = int(len(data) * 0.9)
    train, val = data[:split], data[split:]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(chars), seq_len=args.seq, n_layer=2, n_head=4, d_model=64))
    model.apply(init_weights)
    config = json.loads(Path(args.deepspeed_config).read_text()) if args.deepspeed_config else copy.deepcopy(CONFIG)
    scheduler = config.get("scheduler") or {}
    if scheduler.get("type") in ("WarmupDecayLR", "WarmupCosineLR"):  # the schedule spans the whole run
        scheduler.setdefault("params", {})["total_num_steps"] = args.steps
    state = dsfunc.init_state(model, config)
    model.to(state.program.device)
    cfg, rank, ckpt = state.program.config, dsfunc.get_rank(), Path(args.out_dir) / "ckpt"
    per_rank = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    if args.resume:
        state, saved = dsfunc.load_checkpoint(ckpt, state)
    start = int(state.step)
    if start >= args.steps:  # --steps is the last step, not the number of steps to add
        where = f" (the checkpoint in {ckpt})" if args.resume else ""
        raise SystemExit(f"nothing to do: the run is at step {start}{where} and --steps {args.steps} is the last step "
                         f"to train; pass a --steps beyond {start} to train on")
    if rank == 0:
        print(f"dsfunc {dsfunc.__version__}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(train):,} training and {len(val):,} validation characters, world size {cfg.world_size}, "
              f"ZeRO stage {cfg.zero_optimization.stage}, {cfg.compute_dtype}, device {state.program.device}"
              + (f", resumed from {ckpt} at step {start} (val loss {saved['val_loss']:.3f})" if args.resume else ""))
        print("config:", json.dumps({k: cfg.to_dict()[k] for k in ("optimizer", "scheduler")}))

    first, begin, val_losses = None, time.perf_counter(), []
    for step in range(start + 1, args.steps + 1):
        state = dsfunc.train_step(state, batches(train, per_rank, args.seq, step - 1, rank))
        if step % 25 == 0 or step in (start + 1, args.steps):
            m = state.metrics.to_dict()
            first = m["loss"] if first is None else first
            rate = (step - start) * cfg.train_batch_size * args.seq / (time.perf_counter() - begin)
            if rank == 0:
                print(f"step {step:4d}  loss {m['loss']:.3f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.2f}  "
                      f"tokens/s {rate:,.0f}", flush=True)
        if step % args.eval_interval == 0 or step == args.steps:
            val_losses.append(val_loss(model, state, val, args.seq))
            dsfunc.save_checkpoint(state, ckpt, client_state={"val_loss": val_losses[-1]})
            if rank == 0:
                print(f"step {step:4d}  val loss {val_losses[-1]:.3f}  (checkpoint {ckpt / f'global_step{step}'})",
                      flush=True)
    last = state.metrics.loss.item()
    if rank == 0:
        sample = generate(model, chars, prompt="The ", length=200)
        Path(args.out_dir, "sample.txt").write_text(sample + "\n")
        print(f"done: loss {first:.3f} -> {last:.3f}, val loss {val_losses[-1]:.3f} in "
              f"{time.perf_counter() - begin:.0f} s. A sample:\n\n{sample}\n")
        print(f"wrote {ckpt} (continue with --resume and a larger --steps) and {Path(args.out_dir, 'sample.txt')}")
    if start == 0 and not last < first:  # a resumed run starts low: a few steps more may end on a noisier batch
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
