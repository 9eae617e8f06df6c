"""causal_lm_loss: a Hugging Face causal LM's own loss and gradients, through the fused head + loss."""

from __future__ import annotations

import copy

import pytest
import torch

import dsfunc
from dsfunc.errors import InputError
from dsfunc.models import causal_lm_loss

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> torch.nn.Module:  # a tied head: the embedding's gradient gets both uses
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (3, 12), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt without loss
    mask = torch.ones_like(ids)
    mask[2, -3:] = 0  # right padding
    labels[2, -3:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2-tied"])
def test_loss_and_gradients_are_the_models_own(make):
    torch.manual_seed(0)
    model = make().float()
    batch = _batch()
    ours = causal_lm_loss(model, batch)
    ours.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    theirs = model(**batch).loss
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [0, 3])
def test_training_with_it_follows_the_models_own_loss(stage):
    torch.manual_seed(0)
    model = _llama()
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    fused = dsfunc.init_state(copy.deepcopy(model), config, loss_fn=causal_lm_loss)
    own = dsfunc.init_state(copy.deepcopy(model), config)
    for step in range(3):
        micro = [_batch(2 * step), _batch(2 * step + 1)]
        fused, own = dsfunc.train_step(fused, micro), dsfunc.train_step(own, micro)
        torch.testing.assert_close(fused.metrics.loss, own.metrics.loss, rtol=1e-5, atol=1e-6)
    for name, value in dsfunc.full_params(own).items():  # Adam moved them ~3e-2; float noise in the grads ~1e-5
        torch.testing.assert_close(dsfunc.full_params(fused)[name], value, rtol=0, atol=1e-4, msg=name)


def test_models_and_batches_it_cannot_take_are_refused():
    model = _gpt2()
    with pytest.raises(InputError, match="needs a dict batch with 'labels'"):
        causal_lm_loss(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(InputError, match="needs a Hugging Face causal LM"):
        causal_lm_loss(torch.nn.Linear(2, 2), _batch())
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(InputError, match="soft-caps its logits"):
        causal_lm_loss(model, _batch())
