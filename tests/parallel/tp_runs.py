"""Training runs of a tiny Hugging Face Llama (GQA) for the tensor-parallel tests: one process on the global
batch (the reference), or a rank of a tp x dp mesh on its data-parallel slice of it."""

from __future__ import annotations

from typing import Any

import torch
import transformers

import dsfunc

GLOBAL_BATCH, SEQ, VOCAB, STEPS = 8, 12, 64, 8
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
SGD = {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}


def llama(heads: int = 4, kv_heads: int = 2) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=SEQ, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def ds_config(optimizer: dict[str, Any], stage: int, dp: int, tp: int = 1, **tensor: Any) -> dict[str, Any]:
    """Two micro-batches per step, clipped at 0.05 (below the gradients' norm, so the clip scales every step)."""
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 2, "optimizer": optimizer,
              "gradient_clipping": 0.05, "zero_optimization": {"stage": stage}, "steps_per_print": None}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp, **tensor}
    return config


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def train(config: dict[str, Any], **init: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """8 steps on this rank's data-parallel slice of each global batch: the losses, and the full parameters."""
    state = dsfunc.init_state(llama(), config, **init)
    mesh = state.program.mesh
    dp, rank = mesh.size("dp"), mesh.group("dp").rank
    losses = []
    for step in range(STEPS):
        mine = {k: v.chunk(dp)[rank] for k, v in batch(step).items()}
        state = dsfunc.train_step(state, mine)
        losses.append(float(state.metrics.loss))
    return losses, dsfunc.full_params(state)


def train_rank(rank: int, world_size: int, config: dict[str, Any], init: dict[str, Any]) -> Any:
    return train(config, **init)
