"""Long sequences on one device need every sequence-squared tensor gone: no causal mask, no attention scores, no
position table of S x S, in the forward, the backward or the update of a whole train_step. Every tensor any op
produces is seen through a dispatch mode, so a mask built anywhere (dsfunc, the model, transformers) fails."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsfunc
from dsfunc.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

S = 1024  # an S x S tensor (1M elements) is 8x the largest activation of these tiny models (the MLP's, S x 128)


class LargestOutput(TorchDispatchMode):
    """The largest tensor (elements) any op produced, with the op."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, str] = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), f"{func} -> {tuple(t.shape)}")
        return out


def _hf(kind: str) -> torch.nn.Module:
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": S, "attn_implementation": "sdpa"}
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **sizes))


def _gpt(mlp_shards: int) -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=64, seq_len=S, n_layer=2, n_head=4, d_model=32, fused_loss=True,
                         mlp_shards=mlp_shards))


def _largest(model: torch.nn.Module, batch) -> tuple[torch.Tensor, tuple[int, str]]:
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    state = dsfunc.init_state(model, config)
    seen = LargestOutput()
    with seen:
        state = dsfunc.train_step(state, batch)
    return state.metrics.loss, seen.largest


@pytest.mark.parametrize("kind", ["gpt", "gpt-tiled", "llama", "qwen3", "llama-mask"])
def test_no_tensor_of_sequence_squared_size_in_a_train_step(kind):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, S))
    if kind.startswith("gpt"):
        model, batch = _gpt(8 if kind == "gpt-tiled" else 0), (ids, ids)
    else:
        model = _hf(kind.split("-")[0])
        batch = {"input_ids": ids, "labels": ids}
        if kind == "llama-mask":  # what a data collator passes: all ones, no padding
            batch["attention_mask"] = torch.ones_like(ids)
    loss, (elements, op) = _largest(model, batch)
    assert torch.isfinite(loss)
    assert elements < S * S // 4, f"a sequence-squared tensor: {op}"


def test_a_padded_batch_does_build_the_mask_the_check_looks_for():
    """The control: padding makes transformers build an S x S mask, and the check above sees it."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, S))
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    _, (elements, _) = _largest(_hf("llama"), {"input_ids": ids, "labels": ids, "attention_mask": mask})
    assert elements >= S * S
