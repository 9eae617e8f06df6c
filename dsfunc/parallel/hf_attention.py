"""Sequence parallelism applied to a model: a Hugging Face model's attention routed through Ulysses, and the loss
over the split sequence (:func:`sequence_parallel`).

A Hugging Face attention layer looks its function up by the name in ``config._attn_implementation``
(``ALL_ATTENTION_FUNCTIONS``). :func:`route_attention` registers the Ulysses form of the model's function under a
name of its own and points the model's config at it, so only this model changes (DeepSpeed's ALST instead
replaces the function under its own name, for every model of the process: :func:`replace_attention`, what its
``register_with_transformers`` does). A model that is not a Hugging Face one calls attention itself, through a
:class:`~dsfunc.parallel.ulysses.UlyssesAttention` (DeepSpeed's ``DistributedAttention``).
"""

from __future__ import annotations

import itertools
from typing import Any

from torch import nn

from dsfunc.batch import LossFn
from dsfunc.distributed.comm import Group
from dsfunc.errors import InputError
from dsfunc.parallel.sequence import sequence_parallel_loss
from dsfunc.parallel.ulysses import UlyssesAttention, check_heads, ulysses

_NAMES = itertools.count()  # one registered name per routed model


def sequence_parallel(model: nn.Module, loss_fn: LossFn | None, group: Group, tp: int = 1, *,
                      whole: bool) -> LossFn:
    """Route ``model``'s attention through Ulysses over ``group`` (a Hugging Face model's; any other model must
    hold a :class:`UlyssesAttention`) and return the loss over the sequence split across ``group`` (``whole`` as in
    :func:`~dsfunc.parallel.sequence.sequence_parallel_loss`); ``tp``: the tensor-parallel ranks each layer's heads
    are already split over."""
    if _config(model) is not None:
        route_attention(model, group, tp)
    elif not any(isinstance(m, UlyssesAttention) for m in model.modules()):
        raise InputError(f"sequence_parallel_size {group.size}: {type(model).__name__} is not a Hugging Face model "
                         "(no config._attn_implementation) and holds no UlyssesAttention / DistributedAttention; wrap "
                         "its attention in one (deepspeed.sequence.layer.DistributedAttention)")
    return sequence_parallel_loss(loss_fn, group, whole=whole)


def check_config(config: Any, sp: int, tp: int = 1) -> None:
    """Raise unless the Hugging Face ``config``'s heads, split over ``tp`` ranks (whole: tensor parallelism
    checks that), split over ``sp`` ranks."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    check_heads(heads // tp, (getattr(text, "num_key_value_heads", None) or heads) // tp, sp, tp)


def route_attention(model: nn.Module, group: Group, tp: int = 1) -> None:
    """Point ``model``'s attention at the Ulysses form of its function (once: a model already routed, or whose
    function is already Ulysses', is left as it is); ``tp`` as in :func:`sequence_parallel`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = _config(model)
    name = config._attn_implementation
    check_config(config, group.size, tp)
    attn = _function(name)
    if hasattr(attn, "ulysses_inner"):
        return
    routed = f"dsfunc_ulysses_{next(_NAMES)}_{name}"
    ALL_ATTENTION_FUNCTIONS.register(routed, ulysses(attn, group))
    ALL_MASK_ATTENTION_FUNCTIONS.register(routed, ALL_MASK_ATTENTION_FUNCTIONS[name])
    for module in model.modules():  # sub-models (a vision tower's, a decoder's) may hold configs of their own
        sub = getattr(module, "config", None)
        if sub is not None and getattr(sub, "_attn_implementation", None) == name:
            sub._attn_implementation = routed


def replace_attention(name: str, group: Group, *, in_eval: bool = True) -> None:
    """Replace the attention function registered as ``name`` by its Ulysses form, for every model of the process
    (DeepSpeed ALST's ``register_with_transformers``; ``in_eval`` as in :func:`~dsfunc.parallel.ulysses.ulysses`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[name] = ulysses(_function(name), group, in_eval=in_eval)


def _function(name: str) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ("eager", "paged|eager"):
        raise InputError(f'attn_implementation "{name}" applies a causal mask that Ulysses attention cannot pass on '
                         '(the mask is built for the rank\'s positions only): load the model with '
                         'attn_implementation="sdpa", "flex_attention" or a flash attention')
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise InputError(f"{name!r} is not a registered attention implementation; the choices are "
                         f"{list(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
    return ALL_ATTENTION_FUNCTIONS[name]


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config if config is not None and hasattr(config, "_attn_implementation") else None
