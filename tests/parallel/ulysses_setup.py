"""The tiny Hugging Face Llama (grouped-query attention) and the batches the Ulysses tests train on."""

from __future__ import annotations

import torch

VOCAB, SEQ, MICRO, GAS, STEPS = 64, 16, 2, 2, 8

# the clipping thresholds lie inside the range of the runs' gradient norms (1.3 to 2.6): some steps clip, others
# not, so a gradient off by a constant factor changes the result
ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "gradient_clipping": 1.8}
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}, "gradient_clipping": 1.5}


def llama(heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=48, num_hidden_layers=2, num_attention_heads=heads,
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


def rank_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank``'s loader gives at ``step`` in the ALST script (MICRO samples): on odd ranks, sequences
    of 7 and 5 tokens, so the second sp rank of their split holds padding only."""
    rows = [1, 3] if rank % 2 else [0, 2]
    batch = {k: v[rows] for k, v in replica_batch(step, rank).items()}
    return batch | {"position_ids": torch.arange(SEQ).expand(len(rows), SEQ)}


def one_process(optimizer: dict, batches: list[list[dict[str, torch.Tensor]]]) -> tuple[list[float], dict, list[float]]:
    """The reference: one process, each step the batches of ``batches[step]`` cut into micro-batches of MICRO samples
    (the mean over them is the mean over the parallel run's replicas); its losses, final parameters and gradient
    norms (before clipping)."""
    import dsfunc

    gas = sum(len(b["input_ids"]) for b in batches[0]) // MICRO
    state = dsfunc.init_state(llama(), config(optimizer, gas=gas))
    losses, norms = [], []
    for step in batches:
        state = dsfunc.train_step(state, {k: torch.cat([b[k] for b in step]) for k in step[0]})
        losses.append(state.metrics.loss.item())
        norms.append(state.metrics.grad_norm.item())
    return losses, dsfunc.full_params(state), norms
