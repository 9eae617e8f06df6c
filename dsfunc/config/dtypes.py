"""The config's dtype names (DeepSpeed's ``"fp32"``, ``"fp16"``, ``"bf16"``) and the torch dtypes they name: the
one table every reader of a dtype name, and every writer of one, uses."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
SIXTEEN_BIT = (DTYPES["bf16"], DTYPES["fp16"])  # the compute dtypes whose copies are not the fp32 masters


def dtype_name(dtype: torch.dtype) -> str:
    """The config's name of ``dtype`` (``"bf16"`` for ``torch.bfloat16``); torch's own for one it has none of."""
    return _NAMES.get(dtype, str(dtype))
