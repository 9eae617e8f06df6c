"""DeepSpeed's AutoTP training surface around ``initialize``: ``deepspeed.tp_model_init``, DeepSpeed 0.19's
record-only call (the split happens in ``initialize``, from the config's ``tensor_parallel`` section) that Hugging
Face's Trainer makes when its DeepSpeed config holds ``tensor_parallel.autotp_size`` (the record lives on the model,
and ``initialize`` checks it against the config), and DeepSpeed's batch arithmetic under AutoTP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsfunc.config import Config
from dsfunc.errors import InputError, NotSupportedError

_RECORD = "_dsfunc_tp_model_init"  # the tp size tp_model_init was given, on the model


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> nn.Module:
    """Record ``tp_size`` for ``initialize`` and return ``model`` unchanged (DeepSpeed's rule: the config is
    canonical, and a conflicting ``autotp_size`` is an error)."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise InputError(f"deepspeed.tp_model_init: tp_size must be a positive int, got {tp_size!r}")
    if kwargs.get("tp_group") is not None:
        raise NotSupportedError("deepspeed.tp_model_init(tp_group=...) is not supported by dsfunc: the tp ranks are "
                                "the mesh's tp axis, from tensor_parallel.autotp_size (or init_state(mesh=...))")
    section = config.get("tensor_parallel") if isinstance(config, dict) else None
    size = section.get("autotp_size") if isinstance(section, dict) else None
    if size is not None and size != tp_size:
        raise InputError(f"deepspeed.tp_model_init: tp_size {tp_size} conflicts with the config's "
                         f"tensor_parallel.autotp_size {size}; make them equal")
    model.__dict__[_RECORD] = tp_size
    return model


def check_recorded(model: Any, autotp_size: int) -> None:
    """The config ``initialize`` got must hold the tp size ``tp_model_init`` recorded on ``model``."""
    recorded = getattr(model, "__dict__", {}).get(_RECORD)
    if recorded is not None and recorded != max(autotp_size, 1):
        raise InputError(f"deepspeed.tp_model_init recorded tp_size {recorded}, but the config's "
                         f"tensor_parallel.autotp_size is {autotp_size or 'not set'}: set "
                         f'"tensor_parallel": {{"autotp_size": {recorded}}} in the config')


def batch_config(source: Any, world: int, tp: int) -> Config:
    """The config of ``source`` over ``world`` data-parallel ranks, its batch triple read as DeepSpeed reads it
    under AutoTP: DeepSpeed resolves it before its tp groups exist, over every rank (``world x tp``; Trainer fills
    ``train_batch_size`` the same way), while dsfunc's counts the data-parallel ranks (the tp ranks of a replica
    share its batches). So the micro-batch and accumulation steps are DeepSpeed's, and ``train_batch_size`` the
    global batch a step really takes."""
    if tp <= 1:
        return Config.load(source, world_size=world)
    ds = Config.load(source, world_size=world * tp)
    raw = {**ds.raw, "train_batch_size": ds.train_batch_size // tp,
           "train_micro_batch_size_per_gpu": ds.train_micro_batch_size_per_gpu,
           "gradient_accumulation_steps": ds.gradient_accumulation_steps}
    return Config.load(raw, world_size=world)
