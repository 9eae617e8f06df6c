"""Activation memory with every unit checkpointed, on the BENCH.md 1.3b GPT (GPU only)."""

from __future__ import annotations

import gc

import pytest
import torch

import dsfunc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def activation_peak(policy: str) -> float:
    """GiB allocated above the model states during one training step (micro-batch 8, sequence 1024)."""
    from dsfunc.models.gpt import GPT, GPTConfig, init_weights

    with torch.device("meta"):
        model = GPT(GPTConfig.preset("1.3b"))
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "activation_checkpointing": {"policy": policy}}
    state = dsfunc.init_state(model, config, param_init_fn=init_weights)
    tokens = torch.randint(0, 50304, (8, 1025), device="cuda")
    state = dsfunc.train_step(state, (tokens[:, :-1], tokens[:, 1:]))  # the optimizer moments now exist
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = dsfunc.train_step(state, (tokens[:, :-1], tokens[:, 1:]))
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del state
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def test_checkpointing_every_unit_keeps_at_most_a_third_of_the_activations():
    none, units, selective = activation_peak("none"), activation_peak("units"), activation_peak("selective")
    print(f"activation peak GiB: none {none:.2f}, selective {selective:.2f}, units {units:.2f}")
    assert units <= none / 3, (none, units)
    assert units < selective < none, (none, selective, units)


@pytest.mark.parametrize("policy", ["units", "selective"])
def test_checkpointed_dropout_gradients_equal_the_unchecked_ones_with_fused_attention(policy):
    """CUDA's fused attention draws its dropout from the generator: the selective policy must not save it (a saved
    op is not rerun, so the dropouts after it would draw other masks in the recomputation)."""
    from tests.test_compile import batches, config, gpt

    def first_step(remat: str):
        cfg = {**config(0, 1, None), "gradient_accumulation_steps": 1, "activation_checkpointing": {"policy": remat}}
        state = dsfunc.init_state(gpt(dropout=0.1), cfg, seed=5)
        tokens, targets = batches(0, 1)[0]
        return dsfunc.train_step(state, (tokens[:2], targets[:2])).metrics

    plain, checkpointed = first_step("none"), first_step(policy)
    assert torch.equal(checkpointed.loss, plain.loss)
    assert torch.equal(checkpointed.grad_norm, plain.grad_norm)
