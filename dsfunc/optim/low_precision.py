"""Master weights (and optimizer state) kept in bf16: DeepSpeed's ``bf16.bf16_master_weights_and_grads`` and
``bf16.bf16_optimizer_states``, for the transform-chain update, on the device and on the host (ZeRO-Offload runs
the same chain there, so both round alike, bit for bit).

:func:`low_precision` wraps an optimizer: its moments are stored in bf16, widened to fp32 for the step, and
rounded once when stored — what DeepSpeed's fused and CPU Adam do with bf16 states (fp32 arithmetic, one
round-to-nearest per element). ``rounding="stochastic"`` rounds each stored value up with probability equal to
the dropped remainder instead (unbiased: updates far below a bf16 ulp still move the weights on average), the
masters included; its random bits are a hash of the step, the leaf's path and the element's place in this rank's shard,
so a run repeats exactly, at the same world size. ``rounding="kahan"`` keeps a bf16 compensation per master
(:func:`kahan`): deterministic, and master plus compensation (4 bytes) follow the fp32 sum of the updates.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from dsfunc.optim.base import OptState, Params, Transform, Updates, _check, _zero_count

ROUNDINGS = ("nearest", "stochastic", "kahan")
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
    """State of :func:`low_precision`: applied steps (the random bits' step), the wrapped optimizer's state (its
    non-scalar floating tensors in bf16 when ``states``), and with ``rounding="kahan"`` each bf16 master's
    compensation (what rounding it dropped, in bf16; an empty dict otherwise)."""

    count: Tensor  # int64 0-d
    inner: OptState
    compensation: dict[str, Tensor]


def low_precision(
    inner: Transform, rounding: str = "nearest", dtype: torch.dtype = torch.bfloat16, *, states: bool = True
) -> Transform:
    """``inner`` for masters stored in ``dtype`` (bf16), with its state stored in ``dtype`` too when ``states``:
    widened to fp32 for each update, rounded when stored. DeepSpeed's bf16 master weights keep fp32 moments
    (``states=False``) only under ZeRO-Offload; the arithmetic is the same.

    ``rounding`` says how each new master lands in ``dtype`` (the updates returned then make ``p + u`` exact in
    ``dtype``): ``"nearest"`` leaves ``inner``'s updates as they are (``p + u`` rounds to nearest);
    ``"stochastic"`` rounds the masters and the stored moments stochastically; ``"kahan"`` rounds the masters to
    nearest and keeps what that dropped in a ``dtype`` compensation added to the next update, so master plus
    compensation follow the fp32 sum of the updates to about 16 significant bits (moments to nearest).
    """
    _check(rounding in ROUNDINGS, f"rounding must be one of {ROUNDINGS}, got {rounding!r}")

    def store(new: Any, step: Tensor, salt: int) -> Any:
        if rounding == "stochastic":
            return round_stochastically(new, step, salt)
        return new.to(dtype)

    def init(params: Params) -> LowPrecisionState:
        if states:
            state = optree.tree_map(lambda t: t.to(dtype) if t.dim() > 0 and t.is_floating_point() else t,
                                    inner.init(params))
        else:  # the state of fp32 masters (made from a passing fp32 copy: an init may read the values)
            state = inner.init(optree.tree_map(lambda p: p.float() if _is_low(p, dtype) else p, params))
        compensation = {}
        if rounding == "kahan":
            compensation = {k: torch.zeros_like(p) for k, p in params.items() if _is_low(p, dtype)}
        return LowPrecisionState(_zero_count(params), state, compensation)

    def update(
        updates: Updates, state: LowPrecisionState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, LowPrecisionState]:
        wide = optree.tree_map(lambda t: t.float() if _is_low(t, dtype) else t, state.inner)
        updates, new = inner.update(updates, wide, params, **extra)
        paths, olds, spec = optree.tree_flatten_with_path(state.inner)
        news = spec.flatten_up_to(new)
        stored = [
            store(n, state.count, _salt(path)) if _is_low(o, dtype) else n
            for path, o, n in zip(paths, olds, news)
        ]
        compensation = state.compensation
        if rounding == "stochastic" and params is not None:
            updates = _land_on(
                params, updates, lambda p, u, path: store(p.float() + u, state.count, -1 - _salt(path)), dtype
            )
        elif rounding == "kahan" and params is not None:
            updates, compensation = kahan(params, updates, compensation)
        new_state = LowPrecisionState(state.count + 1, optree.tree_unflatten(spec, stored), compensation)
        return updates, new_state

    return Transform(init, update)


def compensations(opt_state: OptState) -> list[Tensor]:
    """The Kahan compensations in ``opt_state`` (empty unless some :func:`low_precision` rounds with ``"kahan"``):
    part of the masters' bytes rather than the optimizer's."""
    nodes = optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, LowPrecisionState))
    return [c for node in nodes if isinstance(node, LowPrecisionState) for c in node.compensation.values()]


def _salt(path: tuple) -> int:
    """The random bits' salt of a leaf: from its place in the tree (unit names, fields), not its index, so that an
    update of one unit at a time (:mod:`dsfunc.optim.low_precision_host`) draws the bits of the whole tree's."""
    return zlib.crc32(repr(path).encode()) & 0x7FFFFFFF


def _land_on(params: Params, updates: Updates, rounded: Any, dtype: torch.dtype) -> Updates:
    """Updates that take each ``dtype`` parameter ``p`` to ``rounded(p, u, path)`` exactly (the difference of two
    bf16 values whose exponents differ by less than 16 is exact in fp32)."""
    paths, leaves, spec = optree.tree_flatten_with_path(params)
    ups = spec.flatten_up_to(updates)
    out = [
        rounded(p, u, path).float() - p.float() if _is_low(p, dtype) else u
        for path, p, u in zip(paths, leaves, ups)
    ]
    return optree.tree_unflatten(spec, out)


def kahan(params: Mapping[str, Tensor], updates: Mapping[str, Tensor],
          compensation: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Kahan-compensated low-precision masters (``compensation``: one per such master, its dtype): each target
    ``p + (u + c)`` in fp32 rounds to nearest into the new master, and the remainder (exact in fp32: at most half
    an ulp of the master) into the new compensation. Returns updates that land each master on its new value
    exactly (as :func:`_land_on`), and the new compensations."""
    targets = {k: params[k].float() + (updates[k] + c.float()) for k, c in compensation.items()}
    masters = {k: x.to(compensation[k].dtype) for k, x in targets.items()}
    remainders = {k: (x - masters[k].float()).to(compensation[k].dtype) for k, x in targets.items()}
    landed = {k: masters[k].float() - params[k].float() if k in masters else u for k, u in updates.items()}
    return landed, remainders
