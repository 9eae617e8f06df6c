"""``deepspeed.sequence.layer``: ``DistributedAttention``, DeepSpeed's Ulysses attention for models that call
attention themselves, on :class:`dsfunc.parallel.ulysses.UlyssesAttention`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from dsfunc.distributed.comm import Group
from dsfunc.errors import InputError, NotSupportedError
from dsfunc.parallel.ulysses import UlyssesAttention


class DistributedAttention(UlyssesAttention):
    """``DistributedAttention(local_attention, sequence_process_group)``: ``forward(q, k, v, batch_dim_idx)`` with
    ``[seq/sp, batch, heads, d]`` inputs (``batch_dim_idx=1``) or ``[batch, seq/sp, heads, d]`` (0) runs
    ``local_attention`` on every position of ``heads/sp`` heads and returns this rank's positions of every head.
    DeepSpeed's ``scatter_idx``/``gather_idx`` must keep their defaults (heads scattered, sequence gathered);
    heads that do not split evenly and ``sp_stream`` overlap are not supported."""

    def __init__(self, local_attention: Callable[..., Tensor], sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        if (scatter_idx, gather_idx) != (2, 0):
            raise InputError(f"DistributedAttention(scatter_idx={scatter_idx}, gather_idx={gather_idx}): dsfunc "
                             "scatters the heads (dim 2) and gathers the sequence; keep the defaults")
        if sp_stream is not None:
            raise NotSupportedError("DistributedAttention(sp_stream=...) overlap is not supported by dsfunc; "
                                    "pass sp_stream=None")
        super().__init__(local_attention, Group.of(sequence_process_group))
        self.spg = sequence_process_group

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int,  # type: ignore[override]
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> Tensor:
        if batch_dim_idx not in (0, 1):
            raise InputError(f"batch_dim_idx must be 0 ([batch, seq, heads, d]) or 1 ([seq, batch, heads, d]), got "
                             f"{batch_dim_idx}")
        if rotary_pos_emb is not None:
            raise NotSupportedError("DistributedAttention(rotary_pos_emb=...) is not supported by dsfunc: apply the "
                                    "rotary embedding to q and k before the call (with the global positions)")
        return super().forward(query, key, value, *args, seq_dim=1 - batch_dim_idx, heads_dim=2, **kwargs)


__all__ = ["DistributedAttention"]
