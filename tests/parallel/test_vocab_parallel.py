"""The vocabulary split over tp (dsfunc.parallel.vocab): a vocab-parallel embedding and LM head with torch's
loss_parallel cross-entropy, and the fused head + loss (causal_lm_loss) over a head split by rows, train a tiny
Hugging Face Llama at tp 2 like one process (losses within 1e-5 relative, parameters within 1e-4 norm-wise after
8 clipped steps, AdamW and SGD with momentum), and no rank ever holds a token's logits over the whole vocabulary:
every tensor an op makes during a step is recorded (a DTensor by its local part), and none is a full-vocabulary
row of logits, while the model's own plan (logits gathered) is caught by the same probe."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import dsfunc
from dsfunc.models import causal_lm_loss
from tests.multiprocess import run_world
from tests.parallel import tp_runs as runs
from tests.parallel.test_tensor_parallel import assert_like_one_process

BASE = {f"model.layers.*.{m}": s for m, s in (
    ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
    ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
    ("mlp.down_proj", "rowwise"))}
VOCAB_PARALLEL = {**BASE, "model.embed_tokens": "embedding_rowwise", "lm_head": "vocab_parallel"}
MICRO_TOKENS = runs.GLOBAL_BATCH // 2 * runs.SEQ  # one micro-batch's tokens at dp 1


class _LargestLogits(TorchDispatchMode):
    """The most rows of full-vocabulary logits any op's output holds on this rank (a DTensor: its local part).
    At tp 2 the MLP's and attention's local activations are narrower than the vocabulary, so a tensor whose last
    dim is the vocabulary's is logits (or their gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            local = t.to_local() if isinstance(t, DTensor) else t
            if isinstance(local, torch.Tensor) and local.dim() >= 2 and local.shape[-1] == runs.VOCAB:
                self.rows = max(self.rows, local.numel() // runs.VOCAB)
        return out


def train_rank(rank: int, world_size: int, config: dict[str, Any], plan: dict[str, str] | None,
               fused: bool) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """8 steps at tp 2: losses and full parameters (as tp_runs.train), and the most full-vocabulary logit rows
    a tensor held during the first step."""
    init: dict[str, Any] = {"tp_plan": plan} if plan is not None else {}
    if fused:
        init["loss_fn"] = causal_lm_loss
    state = dsfunc.init_state(runs.llama(), config, **init)
    losses, probe = [], _LargestLogits()
    for step in range(runs.STEPS):
        with probe if step == 0 else contextlib.nullcontext():
            state = dsfunc.train_step(state, runs.batch(step))
        losses.append(float(state.metrics.loss))
    return losses, dsfunc.full_params(state), probe.rows


def test_vocab_parallel_embedding_head_and_loss_train_like_one_process():
    config = runs.ds_config(runs.ADAMW, 1, 1, tp=2)
    results = run_world(train_rank, 2, config, VOCAB_PARALLEL, False, timeout=900)
    assert_like_one_process([r[:2] for r in results], "AdamW")
    assert [r[2] for r in results] == [0, 0], "a rank held full-vocabulary logits"


def test_fused_loss_over_a_split_head_trains_like_one_process():
    """The model's own plan splits the head by rows (its logits gathered in its forward); causal_lm_loss never
    runs that forward: the fused loss takes the head's rows and keeps each chunk's logits split."""
    config = runs.ds_config(runs.SGD, 2, 1, tp=2)
    results = run_world(train_rank, 2, config, None, True, timeout=900)
    assert_like_one_process([r[:2] for r in results], "SGD")
    assert [r[2] for r in results] == [0, 0], "a rank held full-vocabulary logits"


def test_the_probe_sees_gathered_logits():
    """The model's own plan with its own loss gathers every token's logits: the probe must see them."""
    config = runs.ds_config(runs.SGD, 1, 1, tp=2)
    results = run_world(train_rank, 2, config, None, False, timeout=900)
    assert_like_one_process([r[:2] for r in results], "SGD")
    assert [r[2] for r in results] == [MICRO_TOKENS] * 2
