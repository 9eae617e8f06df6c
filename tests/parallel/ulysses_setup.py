"""The tiny Hugging Face Llama (grouped-query attention) and the batches the Ulysses tests train on."""

from __future__ import annotations

import torch

VOCAB, SEQ, MICRO, GAS, STEPS = 64, 16, 2, 2, 8

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "gradient_clipping": 0.5}
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}, "gradient_clipping": 0.5}


def llama(heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def replica_batch(step: int, replica: int, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """One data-parallel replica's batch of a step (MICRO * GAS samples): right-padded sequences whose labels are
    -100 on the padding, of lengths that leave the sp ranks different numbers of valid tokens (one sample's second
    half is all padding). Two batches alternate, so that training lowers the loss."""
    g = torch.Generator().manual_seed(1000 * (step % 2) + replica)
    ids = torch.randint(0, VOCAB, (MICRO * GAS, seq), generator=g)
    labels = ids.clone()
    lengths = [seq, seq // 2 - 1, seq - 3, 5][: MICRO * GAS]
    for row, n in enumerate(lengths):
        labels[row, n:] = -100
    return {"input_ids": ids, "labels": labels}


def config(optimizer: dict, *, sp: int = 1, stage: int = 0, gas: int = GAS) -> dict:
    out = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000, **optimizer}
    return out | ({"sequence_parallel_size": sp} if sp > 1 else {})
