"""Grouped experts: every local expert's weights stacked in one tensor per projection, run over the tokens sorted by
expert with one grouped matmul (rows ``offsets[g-1]:offsets[g]`` times expert ``g``'s matrix).

The matmul is ``torch._grouped_mm`` where it takes the operands (on the CPU in torch 2.13: rows whose byte length is
a multiple of 16; on CUDA: bf16, as its kernels need), and otherwise one matmul per expert over its rows. Each gives
every expert's weight a gradient, zero for an expert without rows, so every rank's backward is the same (see
[Note: every expert runs] in :mod:`dsfunc.experts.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def _takes(tokens: Tensor, weights: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on these operands (16-byte aligned rows; bf16 on CUDA)."""
    if not hasattr(torch, "_grouped_mm") or tokens.dtype != weights.dtype:
        return False
    if tokens.is_cuda and tokens.dtype != torch.bfloat16:
        return False
    size = tokens.element_size()
    return all(n * size % 16 == 0 for n in (tokens.size(-1), weights.size(-1), weights.size(-2)))


def grouped_mm(tokens: Tensor, weights: Tensor, offsets: Tensor, *, fused: bool = True) -> Tensor:
    """``tokens`` ``[T, K]`` (sorted by group) times ``weights`` ``[G, K, N]``, group ``g`` for rows
    ``offsets[g-1]:offsets[g]`` (``offsets``: int32 ends, the last ``T``); ``fused``: one ``torch._grouped_mm``
    where it takes the operands."""
    if fused and _takes(tokens, weights):
        return torch._grouped_mm(tokens, weights, offs=offsets)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([tokens[a:b] @ weights[g] for g, (a, b) in enumerate(zip(starts, ends))])


class GroupedExperts(nn.Module):
    """A rank's ``num_local`` gated MLP experts as stacked weights, in Hugging Face's fused layout:
    ``gate_up_proj`` ``[L, 2I, H]`` (gate rows first) and ``down_proj`` ``[L, H, I]``, so a slice of an HF
    block's experts keeps its parameter names and values."""

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor, act_fn: Callable[[Tensor], Tensor], *,
                 fused: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn
        self.fused = fused

    @property
    def num_local(self) -> int:
        return self.gate_up_proj.size(0)

    def forward(self, tokens: Tensor, offsets: Tensor) -> Tensor:
        """``tokens`` ``[T, H]`` sorted by local expert, expert ``g``'s rows ending at ``offsets[g]``."""
        hidden = grouped_mm(tokens, self.gate_up_proj.transpose(1, 2), offsets, fused=self.fused)
        gate, up = hidden.chunk(2, dim=-1)
        return grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offsets, fused=self.fused)
