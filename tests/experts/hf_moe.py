"""Tiny Hugging Face MoE models (Qwen3-MoE, Mixtral, DeepSeek-V2/V3 with a shared expert and group-limited routing:
hidden 32, 2 MoE layers, 4 experts, top-2) and the one-process
reference a data-parallel run of them must equal: the unmodified model, the global batch, loss the mean of the
ranks' losses (the router's load-balancing loss is a function of each rank's own tokens, so the mean over ranks is
what data parallelism trains), torch's clipping and optimizer."""

from __future__ import annotations

import torch
import transformers
from torch import nn

MICRO = 2  # samples per rank
LENGTH = 8
VOCAB = 64
CLIP = 0.5
OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
}


def build(family: str, *, norm_topk_prob: bool = True) -> nn.Module:
    """A tiny model of ``family`` ("qwen3_moe", "mixtral", "deepseek_v2" or "deepseek_v3") with seed-0 weights,
    router logits output on (its load-balancing loss in the loss). DeepSeek's pick 2 of 4 experts in the best of 2
    groups (V3: by sigmoid scores, after a dense first layer), scaled by 1.5, plus a shared expert."""
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "num_experts_per_tok": 2, "output_router_logits": True,
              "router_aux_loss_coef": 0.02, "initializer_range": 0.2, "max_position_embeddings": 64}
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                             norm_topk_prob=norm_topk_prob)
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=16, num_local_experts=4)
        return transformers.MixtralForCausalLM(config)
    deepseek = {**common, "head_dim": 4, "num_key_value_heads": 4, "intermediate_size": 64, "moe_intermediate_size": 16,
                "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                "routed_scaling_factor": 1.5, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                "qk_nope_head_dim": 4, "v_head_dim": 8}
    if family == "deepseek_v2":
        config = transformers.DeepseekV2Config(**deepseek, first_k_dense_replace=0, topk_method="group_limited_greedy")
        return transformers.DeepseekV2ForCausalLM(config)
    config = transformers.DeepseekV3Config(**{**deepseek, "num_hidden_layers": 3}, first_k_dense_replace=1,
                                           norm_topk_prob=norm_topk_prob)
    return transformers.DeepseekV3ForCausalLM(config)


def batch(step: int, samples: int, *, one_token: bool = False) -> torch.Tensor:
    """Step ``step``'s global batch of token ids (``one_token``: each rank's samples one token repeated, so all of
    a rank's tokens go to the same two experts and the others get none of them)."""
    gen = torch.Generator().manual_seed(100 + step)
    if one_token:
        ranks = samples // MICRO
        return torch.randint(0, VOCAB, (ranks, 1, 1), generator=gen).expand(ranks, MICRO, LENGTH).reshape(samples, -1)
    return torch.randint(0, VOCAB, (samples, LENGTH), generator=gen)


def config(world: int, optimizer: str, **sections: object) -> dict:
    return {"train_batch_size": MICRO * world, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": OPTIMIZERS[optimizer], **sections}


def reference(family: str, world: int, optimizer: str, steps: int, *, one_token: bool = False,
              norm_topk_prob: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unmodified model trained in one process on the global batches: the losses and the final parameters."""
    model = build(family, norm_topk_prob=norm_topk_prob)
    kind = OPTIMIZERS[optimizer]
    if kind["type"] == "AdamW":
        opt = torch.optim.AdamW(model.parameters(), **kind["params"])
    else:
        opt = torch.optim.SGD(model.parameters(), **kind["params"])
    losses = []
    for step in range(steps):
        ids = batch(step, MICRO * world, one_token=one_token)
        opt.zero_grad()
        loss = sum(model(input_ids=chunk, labels=chunk).loss for chunk in ids.split(MICRO)) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
