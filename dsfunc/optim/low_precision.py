"""Optimizer state (and master weights) kept in bf16: DeepSpeed's ``bf16.bf16_optimizer_states`` and
``bf16.bf16_master_weights_and_grads``, for the transform-chain update.

:func:`low_precision` wraps an optimizer: its moments are stored in bf16, widened to fp32 for the step, and
rounded once when stored — what DeepSpeed's fused and CPU Adam do with bf16 states (fp32 arithmetic, one
round-to-nearest per element). ``rounding="stochastic"`` rounds each stored value up with probability equal to
the dropped remainder instead (unbiased: updates far below a bf16 ulp still move the weights on average), the
masters included; its random bits are a hash of the step, the leaf and the element's place in this rank's shard,
so a run repeats exactly, at the same world size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from dsfunc.optim.base import OptState, Params, Transform, Updates, _check, _zero_count

ROUNDINGS = ("nearest", "stochastic")
_LOW_BITS = 0xFFFF  # the fp32 bits bf16 drops
_MASK = -0x10000  # 0xFFFF0000 as an int32


def _is_low(t: Any, dtype: torch.dtype) -> bool:
    return isinstance(t, Tensor) and t.dtype == dtype and t.dim() > 0


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 that has its bits."""
    return c - 2**64 if c >= 2**63 else c


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def random_bits(n: int, step: Tensor, salt: int, device: torch.device) -> Tensor:
    """``n`` pseudo-random 16-bit values (int32) from ``(step, salt, index)``: splitmix64's finaliser over int64
    (wrapping products; the shifts masked to be logical) on ``device``, with no host sync (``step`` stays a
    tensor)."""
    h = torch.arange(n, dtype=torch.int64, device=device) * _GOLDEN
    h = h + (step.to(device=device, dtype=torch.int64) * 65599 + salt) * _MIX2
    for mult in (_MIX1, _MIX2):
        h = (h ^ ((h >> 30) & (2**34 - 1))) * mult
    h = h ^ ((h >> 31) & (2**33 - 1))
    return ((h >> 24) & _LOW_BITS).to(torch.int32)


def round_stochastically(x: Tensor, step: Tensor, salt: int) -> Tensor:
    """``x`` (fp32) to bf16, rounding the magnitude up with probability (dropped bits) / 2**16; NaN stays NaN."""
    bits = x.float().contiguous().view(torch.int32)
    noisy = (bits + random_bits(x.numel(), step, salt, x.device).view(x.shape)) & _MASK
    return torch.where(torch.isnan(x), x, noisy.view(torch.float32)).to(torch.bfloat16)


class LowPrecisionState(NamedTuple):
    """State of :func:`low_precision`: applied steps (the random bits' step) and the wrapped optimizer's state,
    its non-scalar floating tensors in bf16."""

    count: Tensor  # int64 0-d
    inner: OptState


def low_precision(
    inner: Transform, rounding: str = "nearest", dtype: torch.dtype = torch.bfloat16
) -> Transform:
    """``inner`` with its state stored in ``dtype`` (bf16): widened to fp32 for each update, rounded when stored.

    With ``rounding="stochastic"`` the parameters that are stored in ``dtype`` (bf16 masters) are rounded
    stochastically too: the updates returned land each of them on its stochastically rounded new value (``p + u``
    is then exact in ``dtype``). With ``"nearest"`` they are ``inner``'s, and ``p + u`` rounds to nearest.
    """
    _check(rounding in ROUNDINGS, f"rounding must be one of {ROUNDINGS}, got {rounding!r}")

    def store(new: Any, step: Tensor, salt: int) -> Any:
        if rounding == "stochastic":
            return round_stochastically(new, step, salt)
        return new.to(dtype)

    def init(params: Params) -> LowPrecisionState:
        state = inner.init(params)
        low = optree.tree_map(lambda t: t.to(dtype) if t.dim() > 0 and t.is_floating_point() else t, state)
        return LowPrecisionState(_zero_count(params), low)

    def update(
        updates: Updates, state: LowPrecisionState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, LowPrecisionState]:
        wide = optree.tree_map(lambda t: t.float() if _is_low(t, dtype) else t, state.inner)
        updates, new = inner.update(updates, wide, params, **extra)
        olds, spec = optree.tree_flatten(state.inner)
        news = spec.flatten_up_to(new)
        stored = [
            store(n, state.count, i) if _is_low(o, dtype) else n for i, (o, n) in enumerate(zip(olds, news))
        ]
        if rounding == "stochastic" and params is not None:
            updates = _land_on(
                params, updates, lambda p, u, i: store(p.float() + u, state.count, -1 - i), dtype
            )
        return updates, LowPrecisionState(state.count + 1, optree.tree_unflatten(spec, stored))

    return Transform(init, update)


def _land_on(params: Params, updates: Updates, rounded: Any, dtype: torch.dtype) -> Updates:
    """Updates that take each ``dtype`` parameter ``p`` to ``rounded(p, u, i)`` exactly (the difference of two
    bf16 values whose exponents differ by less than 16 is exact in fp32)."""
    leaves, spec = optree.tree_flatten(params)
    ups = spec.flatten_up_to(updates)
    out = [
        rounded(p, u, i).float() - p.float() if _is_low(p, dtype) else u
        for i, (p, u) in enumerate(zip(leaves, ups))
    ]
    return optree.tree_unflatten(spec, out)
