"""A Hugging Face causal LM's loss through dsfunc's fused output projection + cross-entropy.

A causal LM's forward makes the logits of every token (in bf16 at vocab 128k, 2 bytes a logit) and its loss
widens them to fp32 (4 more, twice with the softmax and its gradient). :func:`causal_lm_loss` runs the model's
base instead (``model.base_model``: the decoder without its head) and sends the last hidden states and the
head's weight to :func:`dsfunc.kernels.linear_cross_entropy`, which never holds those logits. The loss is the
model's own: the mean cross-entropy of each token's next-token label, ``-100`` ignored, as
``model(**batch).loss`` computes it without ``num_items_in_batch``. Under tensor parallelism a head split by
rows keeps its logits split too (:mod:`dsfunc.parallel.vocab`).

Use it as ``dsfunc.init_state(model, config, loss_fn=causal_lm_loss)``. It takes models whose logits are the
bias-free head applied to the last hidden state; one that changes them (Gemma 2's soft-capping, Cohere's logit
scale) is refused, as is a batch without ``labels``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsfunc.errors import InputError
from dsfunc.kernels.cross_entropy import linear_cross_entropy

IGNORE_INDEX = -100  # Hugging Face's label for a token without a loss


def causal_lm_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The next-token loss of ``batch`` (``input_ids``, ``labels``, and whatever else the model's base takes,
    such as ``attention_mask``) under ``model``, a Hugging Face ``...ForCausalLM``, with no logits in memory."""
    head = _check_model(model)
    if not isinstance(batch, Mapping) or "labels" not in batch:
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise InputError(f"causal_lm_loss needs a dict batch with 'labels' (the tokens to predict, -100 where "
                         f"none), got {keys}; for a model without labels use its own loss")
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    hidden = model.base_model(**inputs, use_cache=False)[0]
    labels = batch["labels"].to(hidden.device)
    target = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)  # token t predicts label t + 1; the last none
    return linear_cross_entropy(hidden, head.weight, target, ignore_index=IGNORE_INDEX, tp_mesh=_tp_mesh(head))


def _tp_mesh(head: nn.Module) -> Any:
    """The tp mesh the head's rows are split over (tensor parallelism), or None."""
    if "_dsfunc_tp" not in head.__dict__:
        return None
    from dsfunc.parallel.vocab import split_head  # DTensor's imports only under tensor parallelism

    return split_head(head)


def _check_model(model: nn.Module) -> nn.Linear:
    """The model's head, if its logits are just ``head(last hidden state)``."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    name = type(model).__name__
    if not isinstance(head, nn.Linear) or getattr(model, "base_model", model) is model:
        raise InputError(f"causal_lm_loss needs a Hugging Face causal LM (a base model and a linear head), got "
                         f"{name}; pass a loss_fn of your own for other models")
    config = getattr(model, "config", None)
    changed = [why for why, present in (
        ("its head has a bias", head.bias is not None),
        ("it soft-caps its logits (final_logit_softcapping)", getattr(config, "final_logit_softcapping", None)),
        ("it scales its logits (logit_scale)", hasattr(model, "logit_scale") or getattr(config, "logit_scale", None)),
    ) if present]
    if changed:
        raise InputError(f"causal_lm_loss: {name}'s logits are not head(hidden) alone: {'; '.join(changed)}. "
                         "Use the model's own loss (no loss_fn)")
    return head
