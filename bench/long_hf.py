"""Hugging Face Llama shapes at long sequences, one training step each: plain HF + DeepSpeed ZeRO-3 offload against
the same model under dsfunc with ALST's tiled compute (bench_long_sequence.py's ``hf+...`` systems).

* ``hf+deepspeed``: ``LlamaForCausalLM`` made under ``deepspeed.zero.Init``, real DeepSpeed ZeRO-3 with
  ``offload_optimizer`` to pinned host memory, HF's ``gradient_checkpointing`` (non-reentrant), the model's own
  loss (``model(input_ids, labels=...).loss``: every token's logits, then fp32 cross-entropy).
* ``hf+dsfunc``: the same model (made on ``meta``, each rank materialising its shard) under dsfunc ZeRO-3 with
  ``offload_optimizer``, every decoder layer checkpointed with ``cpu_checkpointing`` (the saved layer inputs in
  pinned host memory, copied out and prefetched back asynchronously; the last ``device_checkpoints`` layers' kept on
  the GPU where the host is the limit), each MLP tiled over the sequence (:func:`tile_mlps`: ALST's patch of ``LlamaMLP.forward``
  with ``TiledMLP``) and the loss tiled over the LM head (:func:`tiled_causal_lm_loss`).
* ``+bf16`` (either): bf16 master weights, gradients and optimizer states (``bf16_master_weights_and_grads``,
  ``bf16_optimizer_states``): 8B's fp32 Adam states alone (16 B a parameter) nearly fill a 128 GiB host.

Attention is SDPA with no attention mask (causal through ``is_causal``: no S x S mask) and position ids
``arange(S)`` (HF's default), so nothing in the model grows with the square of the sequence.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc.deepspeed.ulysses_sp import TiledMLP
from dsfunc.tiling import default_shards, tiled_loss

IGNORE_INDEX = -100  # HF's label without a loss
LOSS_SLICE_BYTES = 2**30  # a loss slice's fp32 logits: tokens x vocab x 4 B (ALST keeps them about this size)
# Llama 3.1 8B's shape; Llama 3.2 1B's (a 1.3b-class model, its head tied to the embedding); a tiny one like it
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
    "llama-tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 128, "tie_word_embeddings": True},
}
ADAMW = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}


def llama_config(shape: str | dict[str, Any], seq: int) -> Any:
    import transformers

    kwargs = SHAPES[shape] if isinstance(shape, str) else shape
    return transformers.LlamaConfig(**kwargs, max_position_embeddings=seq, attn_implementation="sdpa",
                                    use_cache=False)


def meta_llama(shape: str | dict[str, Any], seq: int) -> nn.Module:
    """The model on ``meta`` (no memory) but for its rotary embedding, whose ``inv_freq`` buffer is computed, not
    initialised: made for real, it keeps its value through dsfunc's materialisation."""
    import transformers

    config = llama_config(shape, seq)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model


def init_llama(module: nn.Module) -> None:
    """``param_init_fn`` for :func:`meta_llama`'s model: HF's initialisation (normal(0, 0.02), norms at 1)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    elif "weight" in module._parameters:  # the RMS norms
        nn.init.ones_(module.weight)


def _tiled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """ALST's ``tiled_mlp_forward``: the class's own forward a slice of the sequence at a time (slices about as
    long as the model is wide)."""
    return TiledMLP.apply(type(self).__mro__[1].forward, self, x, default_shards(x.shape[-2], x.shape[-1]))


def tile_mlps(model: nn.Module) -> int:
    """Tile every decoder layer's MLP over the sequence (ALST patches ``LlamaMLP.forward``; here each instance's
    class becomes a subclass with the tiled forward, so other models in the process stay as they are and a copy of
    the model keeps the tiling). Returns how many."""
    count = 0
    for layer in model.base_model.layers:
        base = type(layer.mlp)
        layer.mlp.__class__ = type(f"Tiled{base.__name__}", (base,), {"forward": _tiled_forward})
        count += 1
    return count


def loss_shards(seq: int, vocab: int) -> int:
    return max(1, math.ceil(seq * vocab * 4 / LOSS_SLICE_BYTES))


def _slice_loss(hidden: torch.Tensor, target: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, head).float()
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss (token t predicts label t + 1, ``-100`` ignored, the mean over counted tokens) with the
    head and the cross-entropy a slice of the sequence at a time (:func:`dsfunc.tiling.tiled_loss`, ALST's
    ``TiledFusedLogitsLoss``): one slice's logits alive at a time."""
    hidden = model.base_model(input_ids=batch["input_ids"], use_cache=False)[0]
    target = F.pad(batch["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)
    head = model.get_output_embeddings().weight
    total = tiled_loss(_slice_loss, hidden, target, shards=loss_shards(hidden.shape[1], head.shape[0]),
                       weights=(head,), dim=1)
    return total / (target != IGNORE_INDEX).sum()


def _bf16(options: set[str]) -> dict[str, Any]:
    states = "bf16" in options
    return {"enabled": True, "bf16_master_weights_and_grads": states, "bf16_optimizer_states": states}


def dsfunc_config(options: set[str], optimizer: dict[str, Any] = ADAMW, clip: float = 1.0,
                  bf16: bool = True, device_checkpoints: int = 0) -> dict[str, Any]:
    """hf+dsfunc's config: ZeRO-3, the optimizer on the host, every layer checkpointed into host memory but the last
    ``device_checkpoints``."""
    checkpointing = {"policy": "units", "cpu_checkpointing": True, "device_checkpoints": device_checkpoints}
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer, "gradient_clipping": clip,
            "bf16": _bf16(options) if bf16 else {"enabled": False},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "activation_checkpointing": checkpointing, "steps_per_print": None}


def build_dsfunc(shape: str, seq: int, options: set[str], device: torch.device,
                 report: Callable[[str], None] = lambda phase: None, device_checkpoints: int = 0) -> Any:
    """hf+dsfunc's state; ``report("forward")`` runs when the step's forward is done."""
    model = meta_llama(shape, seq)
    tile_mlps(model)

    def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = tiled_causal_lm_loss(module, batch)
        report("forward")
        return loss

    config = dsfunc_config(options, device_checkpoints=device_checkpoints)
    return dsfunc.init_state(model, config, loss_fn=loss_fn, param_init_fn=init_llama, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tokens(vocab: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1234)
    ids = torch.randint(0, vocab, (1, seq), device=device, generator=g)
    return {"input_ids": ids, "labels": ids}


def run_dsfunc(shape: str, seq: int, options: set[str], device: torch.device,
               report: Callable[[str], None], device_checkpoints: int = 0) -> tuple[float, float]:
    """One step of hf+dsfunc: (seconds, loss)."""
    state = build_dsfunc(shape, seq, options, device, report, device_checkpoints)
    batch = tokens(SHAPES[shape]["vocab_size"], seq, device)
    _sync(device)
    start = time.perf_counter()
    state = dsfunc.train_step(state, batch)
    loss = state.metrics.loss.item()
    _sync(device)
    return time.perf_counter() - start, loss


def deepspeed_config(options: set[str], device: torch.device) -> dict[str, Any]:
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": device.type == "cuda"}}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": ADAMW, "bf16": _bf16(options), "zero_optimization": zero, "steps_per_print": 10**9}


def run_deepspeed(shape: str, seq: int, options: set[str], device: torch.device,
                  report: Callable[[str], None]) -> tuple[float, float]:
    """One step of hf+deepspeed: (seconds, loss); DeepSpeedCPUAdam updates on the host."""
    import deepspeed
    import transformers

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29733"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = deepspeed_config(options, device)
    # resolved (imported) before zero.Init patches torch.Tensor.__new__, which torch._dynamo's import then refuses
    model_class = transformers.LlamaForCausalLM
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = model_class(llama_config(shape, seq))
    for module in model.modules():  # dsfunc's initialisation, one module gathered at a time
        with deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
            init_llama(module)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = tokens(SHAPES[shape]["vocab_size"], seq, device)
    _sync(device)
    start = time.perf_counter()
    loss = engine(**batch, use_cache=False).loss
    report("forward")
    engine.backward(loss)
    engine.step()
    value = loss.item()
    _sync(device)
    elapsed = time.perf_counter() - start
    engine.destroy()
    return elapsed, value


RUNNERS = {"dsfunc": run_dsfunc, "deepspeed": run_deepspeed}
