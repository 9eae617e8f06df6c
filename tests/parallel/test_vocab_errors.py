"""What the vocabulary split refuses, in one process: the "vocab_parallel" style on a module that is not the
model's LM head, and a cross-entropy given logits that are not split along the vocabulary."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from dsfunc.config import TensorParallelConfig
from dsfunc.parallel.autotp import resolve_plan
from dsfunc.parallel.vocab import vocab_parallel_cross_entropy
from tests.parallel import tp_runs as runs


def test_vocab_parallel_is_for_the_lm_head():
    with pytest.raises(dsfunc.InputError, match="'model.layers.0.mlp.up_proj' is not LlamaForCausalLM's"):
        resolve_plan(runs.llama(), TensorParallelConfig(), {"model.layers.0.mlp.up_proj": "vocab_parallel"})


def test_the_head_style_binds_the_models_own_loss():
    model = runs.llama()
    plan = resolve_plan(model, TensorParallelConfig(), {"lm_head": "vocab_parallel"})
    assert list(plan) == ["lm_head"]
    assert model.loss_function.__name__ == "causal_lm_loss_function"


def test_cross_entropy_needs_vocab_split_logits():
    with pytest.raises(dsfunc.InputError, match="needs logits as a DTensor sharded on the vocabulary"):
        vocab_parallel_cross_entropy(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
