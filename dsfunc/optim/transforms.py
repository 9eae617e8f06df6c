"""The small factories optimizers are chained from: clipping, weight decay, Adam's and Adagrad's
directions, momentum, LAMB's trust ratio, schedules and the learning rate.

A learning rate may be a float or a :data:`~dsfunc.schedules.Schedule`; ``scale_by_learning_rate``
evaluates a schedule at ``count - 1`` (see :mod:`dsfunc.schedules` for why).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from dsfunc.kernels.adam import bias_corrections
from dsfunc.optim.base import (
    OptState,
    Params,
    ScalarOrSchedule,
    Transform,
    Updates,
    _check,
    _map,
    _need_params,
    _value_at,
    _zero_count,
    identity,
    stateless,
)
from dsfunc.schedules import Schedule


def global_norm(tree: Any) -> Tensor:
    """L2 norm over all leaves, as a float32 0-d tensor (0 for an empty tree)."""
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(x, dtype=torch.float32) for x in leaves])
    return torch.linalg.vector_norm(norms)


def scale_by_factor(extra_key: str = "grad_scale") -> Transform:
    """Multiply every update by the 0-d tensor ``extra[extra_key]``; identity when it is not passed.

    The step passes ``1 / (clip * loss_scale)`` here, so loss unscaling and DeepSpeed's gradient clipping are one
    multiply: ``clip = max(1, (norm / loss_scale + 1e-6) / max_norm)``.
    """

    def fn(updates: Updates, params: Params | None, **extra: Any) -> Updates:
        factor = extra.get(extra_key)
        if factor is None:
            return updates
        return _map(lambda u: u * factor, updates)

    return stateless(fn)


def clip_by_global_norm(max_norm: float) -> Transform:
    """DeepSpeed's clipping: ``u * (1 / c)`` with ``c = max(1, (norm + 1e-6) / max_norm)``.

    ``norm`` is ``extra["global_norm"]`` (a 0-d tensor the step has already reduced across ranks) when given, else
    the norm of the updates. ``max_norm <= 0`` means no clipping (DeepSpeed's ``gradient_clipping: 0``).
    """
    if max_norm <= 0:
        return identity()

    def fn(updates: Updates, params: Params | None, **extra: Any) -> Updates:
        norm = extra.get("global_norm")
        if norm is None:
            norm = global_norm(updates)
        inv_coef = clip_coefficient(norm, max_norm)
        return _map(lambda u: u * inv_coef, updates)

    return stateless(fn)


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """What :func:`clip_by_global_norm` multiplies the updates by: ``1 / max(1, (norm + 1e-6) / max_norm)``."""
    return ((norm + 1e-6) / max_norm).clamp_min(1.0).reciprocal()


def add_decayed_weights(weight_decay: float) -> Transform:
    """``u = u.add(p, alpha=weight_decay)``: before the optimizer's scaling it is L2 regularisation, after it the
    decoupled (AdamW) decay. ``weight_decay == 0`` is the identity."""
    _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay!r}")
    if weight_decay == 0:
        return identity()

    def fn(updates: Updates, params: Params | None, **extra: Any) -> Updates:
        params = _need_params(params, "add_decayed_weights")
        return _map(lambda u, p: u.add(p, alpha=weight_decay), updates, params)

    return stateless(fn)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: applied steps so far and the first and second moments."""

    count: Tensor  # int64 0-d
    mu: Updates
    nu: Updates


def scale_by_adam(b1: ScalarOrSchedule = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  bias_correction: bool = True) -> Transform:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)``, as this exact sequence of torch calls (a fused kernel
    mirrors it bit for bit)::

        m = m.mul(b1).add(g, alpha=1 - b1)
        v = v.mul(b2).addcmul(g, g, value=1 - b2)
        t = count + 1                                   # count: int64 0-d, applied steps before this one
        bc1, bc2_sqrt = bias_corrections(b1, b2, t)     # float32 0-d; torch.ones(()) when not bias_correction
        u = (m / bc1) / (v.sqrt() / bc2_sqrt).add(eps)

    The bias corrections (:func:`dsfunc.kernels.adam.bias_corrections`) are float32 0-d tensors on the params'
    device (no host sync), computed in float64 and rounded once, as torch.optim.AdamW's Python floats are: so the
    updates agree with torch.optim.AdamW to float32 rounding.

    ``b1`` may be a schedule (DeepSpeed's OneCycle cycles ``betas[0]``): then ``b1 = schedule(count - 1)`` as a
    float32 0-d tensor and the first line is ``m.mul(b1).add(g.mul(1 - b1))``.
    """
    _check(eps >= 0, f"eps must be >= 0, got {eps!r}")

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(_zero_count(params), _map(torch.zeros_like, params), _map(torch.zeros_like, params))

    def update(updates: Updates, state: ScaleByAdamState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, ScaleByAdamState]:
        beta1 = _value_at(b1, state.count)
        if isinstance(beta1, Tensor):
            mu = _map(lambda m, g: m.mul(beta1).add(g.mul(1 - beta1)), state.mu, updates)
        else:
            mu = _map(lambda m, g: m.mul(beta1).add(g, alpha=1 - beta1), state.mu, updates)
        nu = _map(lambda v, g: v.mul(b2).addcmul(g, g, value=1 - b2), state.nu, updates)
        count = state.count + 1
        if bias_correction:
            bc1, bc2_sqrt = bias_corrections(beta1, b2, count)
        else:
            bc1 = bc2_sqrt = torch.ones((), dtype=torch.float32, device=count.device)
        out = _map(lambda m, v: (m / bc1) / (v.sqrt() / bc2_sqrt).add(eps), mu, nu)
        return out, ScaleByAdamState(count, mu, nu)

    return Transform(init, update)


def scale_by_trust_ratio(min_coeff: float = 0.01, max_coeff: float = 10.0) -> Transform:
    """LAMB's layer-wise trust ratio: ``u * clamp(||p|| / ||u||, min_coeff, max_coeff)``, 1 when either norm is 0.

    Norms are per parameter. ``extra["segment_norm"]``, when given, maps a tree of per-element squares to a tree of
    per-element norms broadcast over each parameter's elements (the step's way to handle flat shards that hold
    several parameters across ranks); without it each leaf is one parameter.
    """
    _check(0 < min_coeff <= max_coeff, f"need 0 < min_coeff <= max_coeff, got {min_coeff!r}, {max_coeff!r}")

    def fn(updates: Updates, params: Params | None, **extra: Any) -> Updates:
        params = _need_params(params, "scale_by_trust_ratio (lamb)")
        p_sq = _map(lambda p: p * p, params)
        u_sq = _map(lambda u: u * u, updates)
        segment_norm = extra.get("segment_norm")
        if segment_norm is None:
            p_norm, u_norm = _map(lambda x: x.sum().sqrt(), p_sq), _map(lambda x: x.sum().sqrt(), u_sq)
        else:
            p_norm, u_norm = segment_norm(p_sq), segment_norm(u_sq)

        def scaled(u: Tensor, pn: Tensor, un: Tensor) -> Tensor:
            ratio = torch.where((pn > 0) & (un > 0), (pn / un).clamp(min_coeff, max_coeff), 1.0)
            return u * ratio

        return _map(scaled, updates, p_norm, u_norm)

    return stateless(fn)


class TraceState(NamedTuple):
    """State of :func:`trace`: applied steps so far and the momentum buffer."""

    count: Tensor  # int64 0-d
    buf: Updates


def trace(momentum: float, dampening: float = 0.0, nesterov: bool = False) -> Transform:
    """torch.optim.SGD's momentum: ``buf = g`` on the first step, then ``buf = buf * momentum + (1 - dampening)
    * g``; the update is ``buf`` or, with nesterov, ``g + momentum * buf``."""
    _check(momentum >= 0, f"momentum must be >= 0, got {momentum!r}")
    _check(not nesterov or (momentum > 0 and dampening == 0),
           "nesterov momentum requires momentum > 0 and dampening == 0")

    def init(params: Params) -> TraceState:
        return TraceState(_zero_count(params), _map(torch.zeros_like, params))

    def update(updates: Updates, state: TraceState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, TraceState]:
        first = state.count == 0
        buf = _map(lambda b, g: torch.where(first, g, b.mul(momentum).add(g, alpha=1 - dampening)),
                   state.buf, updates)
        out = _map(lambda g, b: g.add(b, alpha=momentum), updates, buf) if nesterov else buf
        return out, TraceState(state.count + 1, buf)

    return Transform(init, update)


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: the running sum of squared gradients."""

    sum_of_squares: Updates


def scale_by_rss(initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> Transform:
    """Adagrad's direction: ``s = s.addcmul(g, g)``, ``u = g / (s.sqrt() + eps)``."""
    _check(initial_accumulator_value >= 0,
           f"initial_accumulator_value must be >= 0, got {initial_accumulator_value!r}")
    _check(eps >= 0, f"eps must be >= 0, got {eps!r}")

    def init(params: Params) -> ScaleByRssState:
        return ScaleByRssState(_map(lambda p: torch.full_like(p, initial_accumulator_value), params))

    def update(updates: Updates, state: ScaleByRssState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, ScaleByRssState]:
        sums = _map(lambda s, g: s.addcmul(g, g, value=1), state.sum_of_squares, updates)
        out = _map(lambda g, s: g / s.sqrt().add(eps), updates, sums)
        return out, ScaleByRssState(sums)

    return Transform(init, update)


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: applied steps so far."""

    count: Tensor  # int64 0-d


def scale_by_schedule(schedule: Schedule) -> Transform:
    """Multiply updates by ``schedule(count - 1)`` (the same t convention as :func:`scale_by_learning_rate`)."""

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(_zero_count(params))

    def update(updates: Updates, state: ScaleByScheduleState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, ScaleByScheduleState]:
        factor = _value_at(schedule, state.count)
        return _map(lambda u: u * factor, updates), ScaleByScheduleState(state.count + 1)

    return Transform(init, update)


class ScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate`: applied steps so far, and the lr the last step used (before the
    first step: the lr the first step will use, i.e. what DeepSpeed's scheduler writes at construction)."""

    count: Tensor  # int64 0-d
    lr: Tensor  # float32 0-d


def scale_by_learning_rate(lr: ScalarOrSchedule) -> Transform:
    """``u = u * (-lr)``; ``lr`` is a float or a schedule evaluated at ``count - 1`` (DeepSpeed's t: the k-th
    applied step uses ``schedule(k - 1)``). An ``lr=`` extra of ``update`` (not None) replaces it for that step.
    The state records the lr used (:func:`current_lr`)."""
    _check(callable(lr) or lr >= 0, f"lr must be >= 0 or a schedule, got {lr!r}")

    def init(params: Params) -> ScheduleState:
        count = _zero_count(params)
        if callable(lr):
            return ScheduleState(count, _value_at(lr, count))
        return ScheduleState(count, torch.full((), float(lr), dtype=torch.float32, device=count.device))

    def update(updates: Updates, state: ScheduleState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, ScheduleState]:
        given = extra.get("lr")  # this step's lr, set by the caller (UpdateContext.lr)
        if given is not None:
            step_lr = torch.full((), float(given), dtype=torch.float32, device=state.count.device)
        else:
            step_lr = _value_at(lr, state.count) if callable(lr) else state.lr
        return _map(lambda u: u * (-step_lr), updates), ScheduleState(state.count + 1, step_lr)

    return Transform(init, update)


def current_lr(opt_state: OptState) -> Tensor | None:
    """The lr the last step used (float32 0-d), from the first :class:`ScheduleState` in ``opt_state``; None when
    there is none."""
    found = optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleState), none_is_leaf=False)
    for node in found:
        if isinstance(node, ScheduleState):
            return node.lr
    return None
