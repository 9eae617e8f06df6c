"""``deepspeed.runtime.swap_tensor``: DeepSpeed's NVMe swapping (ZeRO-Infinity), which dsfunc does not build (an
``"nvme"`` offload device is refused by the config). Its size constant answers, since scripts and tests size
tensors by it; every other name imports and refuses when used."""

from __future__ import annotations

from typing import Any

from dsfunc.deepspeed.namespace import other_name

MIN_SWAPPABLE_BYTES = 1 << 20
"""DeepSpeed's smallest tensor (1 MiB) its swapper moves to NVMe; dsfunc swaps nothing."""


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.swap_tensor`` import, and refuse when used."""
    return other_name("runtime.swap_tensor", name)
