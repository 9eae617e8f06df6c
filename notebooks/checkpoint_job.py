"""Resume a checkpoint on several ranks; run by 03_checkpoints.ipynb through the dsfunc launcher.

    python -m dsfunc.cli --num_gpus 4 checkpoint_job.py --ckpt ckpt/ --stage 3 --steps 10 --losses losses.json

Every rank builds the model, loads the newest checkpoint in ``--ckpt`` (whatever world size and ZeRO stage
wrote it), trains ``--steps`` more steps on its slice of each global batch, and saves a new checkpoint
there. The model, the config and the data are defined here once and imported by the notebook, so both
sides train the very same run.
"""

from __future__ import annotations

import argparse
import json
import os
import pydoc_data.topics

import torch

import dsfunc
from dsfunc.checkpoint import load_checkpoint, save_checkpoint
from dsfunc.models import GPT, GPTConfig
from dsfunc.models.gpt import init_weights

TEXT = "\n".join(pydoc_data.topics.topics.values())  # the Python reference manual, shipped with Python
CHARS = sorted(set(TEXT))
DATA = torch.tensor([CHARS.index(c) for c in TEXT[:200_000]], dtype=torch.long)
SEQ = 64
GLOBAL_BATCH = 16


def make_model() -> GPT:
    """A small character-level GPT (its input and output embeddings are tied)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(CHARS), seq_len=SEQ, n_layer=2, n_head=4, d_model=64))
    model.apply(init_weights)  # GPT-2's N(0, 0.02) initialisation
    return model


def config(stage: int) -> dict:
    """The same run at any world size: 16 sequences per step, 4 per micro-batch (the gradient accumulation
    steps follow from the world size: 4 on one rank, 1 on four)."""
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 40, "warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's batch (inputs, next-character targets): a pure function of the step number."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(DATA) - SEQ - 1, (GLOBAL_BATCH,), generator=g)
    windows = torch.stack([DATA[s : s + SEQ + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """This rank's contiguous share of a global batch."""
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", required=True, help="checkpoint directory to resume from and save into")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage of this run")
    parser.add_argument("--steps", type=int, default=10, help="steps to train after resuming")
    parser.add_argument("--losses", required=True, help="JSON file for the losses (written by rank 0)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher; unused")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        dsfunc.init_distributed(verbose=False)
    rank, world = dsfunc.get_rank(), dsfunc.get_world_size()

    state = dsfunc.init_state(make_model(), config(args.stage))
    state, client = load_checkpoint(args.ckpt, state)
    losses = {}
    for step in range(client["next_step"], client["next_step"] + args.steps):
        state = dsfunc.train_step(state, rank_slice(global_batch(step), rank, world))
        losses[step] = state.metrics.loss.item()
    save_checkpoint(state, args.ckpt, client_state={"next_step": step + 1})
    if rank == 0:
        with open(args.losses, "w") as f:
            json.dump({"world_size": world, "stage": args.stage, "losses": losses}, f)


if __name__ == "__main__":
    main()
