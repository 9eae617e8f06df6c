"""``deepspeed.compression.helper``: the two module helpers scripts import from it (LoRA code does);
DeepSpeed's compression itself (``init_compression``, ``redundancy_clean``, ...) raises when called."""

from __future__ import annotations

from typing import Any

from dsfunc.deepspeed.utils import recursive_getattr, recursive_setattr
from dsfunc.errors import unsupported

__all__ = ["recursive_getattr", "recursive_setattr"]


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    return unsupported(f"deepspeed.compression.{name}", "model compression")
