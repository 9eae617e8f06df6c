"""``deepspeed.checkpoint.utils``: the helper libraries call before ``torch.save`` of a state dict
(``deepspeed.checkpoint`` itself is dsfunc's checkpoint package, :mod:`dsfunc.checkpoint`)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from dsfunc.errors import unsupported


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor in it (nested in lists, tuples and dicts) replaced by a detached copy
    on ``device``, so that ``torch.save`` writes each tensor's own values, not a larger storage it views."""
    return optree.tree_map(lambda x: x.detach().clone().to(device) if isinstance(x, torch.Tensor) else x, item,
                           none_is_leaf=True)


def __getattr__(name: str) -> Any:
    """DeepSpeed's other helpers of the module import, and raise when called: they name its checkpoint files
    (``get_model_ckpt_name_for_rank``, ...), whose layout dsfunc's checkpoints do not have."""
    if name.startswith("_"):
        raise AttributeError(f"module 'deepspeed.checkpoint.utils' has no attribute {name!r}")
    return unsupported(f"deepspeed.checkpoint.utils.{name}", "DeepSpeed's checkpoint file layout",
                       "read checkpoints with dsfunc.load_checkpoint or dsfunc.export_fp32")
