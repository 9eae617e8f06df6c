"""Helpers shared by the config tests: load a config with train_batch_size 8, or get its error message."""

from __future__ import annotations

import pytest

from dsfunc.config import Config, ConfigError


def load(extra: dict | None = None, world_size: int = 1, **top) -> Config:
    """A config with train_batch_size 8 plus the given keys."""
    return Config.load({"train_batch_size": 8 * world_size, **(extra or {}), **top}, world_size=world_size)


def error(config: dict, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(config, world_size=world_size)
    return str(info.value)


ADAM_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "bias_correction": True,
    "adam_w_mode": True,
    "torch_adam": False,
}
