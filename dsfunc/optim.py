"""Update transforms: optimizers, clipping and learning rates as pure ``(init, update)`` pairs (the optax pattern).

A :class:`Transform` works on any optree pytree of tensors. ``init(params)`` returns the optimizer state (NamedTuples,
tuples and dicts of tensors; step counters are int64 0-d tensors on the params' device), and
``update(updates, state, params=None, **extra) -> (updates, state)`` returns new values without touching its inputs.
Every transform ignores extras it does not know, so a step can pass e.g. ``grad_scale``, ``global_norm`` and
``segment_norm`` to a whole chain. Nothing here reads a tensor back to the host or branches on a tensor's value.

Named optimizers are :func:`named_chain` s of the small factories, so their state reads like
``state["adam"].mu`` and ``state["lr"].lr``; they take DeepSpeed's parameter names. A learning rate may be a float
or a :data:`~dsfunc.schedules.Schedule`; ``scale_by_learning_rate`` evaluates a schedule at ``count - 1`` (see
:mod:`dsfunc.schedules` for why).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from dsfunc.schedules import Schedule

Params = Any
Updates = Any
OptState = Any
ScalarOrSchedule = float | Schedule


class Transform(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra) -> (updates, state)``."""

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


class ScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate`: applied steps so far, and the lr the last step used (before the
    first step: the lr the first step will use, i.e. what DeepSpeed's scheduler writes at construction)."""

    count: Tensor  # int64 0-d
    lr: Tensor  # float32 0-d


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: applied steps so far."""

    count: Tensor  # int64 0-d


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: applied steps so far and the first and second moments."""

    count: Tensor  # int64 0-d
    mu: Updates
    nu: Updates


class TraceState(NamedTuple):
    """State of :func:`trace`: applied steps so far and the momentum buffer."""

    count: Tensor  # int64 0-d
    buf: Updates


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: the running sum of squared gradients."""

    sum_of_squares: Updates


def _map(fn: Callable[..., Tensor], tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest)


def _device(tree: Any) -> torch.device:
    leaves = optree.tree_leaves(tree)
    return leaves[0].device if leaves else torch.device("cpu")


def _zero_count(params: Params) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=_device(params))


def _value_at(value: ScalarOrSchedule, count: Tensor) -> Tensor | float:
    """A float as is, or a schedule evaluated at DeepSpeed's t = count - 1, as a float32 0-d tensor."""
    return value(count - 1).to(torch.float32) if callable(value) else value


def _need_params(params: Params | None, who: str) -> Params:
    if params is None:
        raise ValueError(f"{who} needs the parameters: call update(updates, state, params)")
    return params


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_betas(betas: Sequence[ScalarOrSchedule], who: str) -> tuple[ScalarOrSchedule, float]:
    _check(len(betas) == 2, f"{who}: betas must be a pair (beta1, beta2), got {betas!r}")
    b1, b2 = betas
    _check(callable(b1) or 0.0 <= b1 < 1.0, f"{who}: betas[0] must be in [0, 1), got {b1!r}")
    _check(0.0 <= b2 < 1.0, f"{who}: betas[1] must be in [0, 1), got {b2!r}")
    return b1, float(b2)


def stateless(fn: Callable[..., Updates]) -> Transform:
    """A transform with :class:`EmptyState` from ``fn(updates, params, **extra) -> updates``."""

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, EmptyState]:
        return fn(updates, params, **extra), state

    return Transform(init, update)


def identity() -> Transform:
    """Leaves updates unchanged."""
    return stateless(lambda updates, params, **extra: updates)


def chain(*transforms: Transform) -> Transform:
    """Apply ``transforms`` in order; the state is the tuple of their states."""

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Updates, state: tuple, params: Params | None = None, **extra: Any) -> tuple[Updates, tuple]:
        if len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transforms got a state of {len(state)} entries; "
                             f"was the state made by this chain's init?")
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    return Transform(init, update)


def named_chain(*named: tuple[str, Transform]) -> Transform:
    """Apply the transforms in order; the state is a dict ``name -> state``.

    >>> tx = named_chain(("clip", clip_by_global_norm(1.0)), ("sgd", sgd(lr=0.1)))
    >>> sorted(tx.init({"w": torch.zeros(3)}))
    ['clip', 'sgd']
    """
    names = [n for n, _ in named]
    for entry in named:
        _check(isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
               and isinstance(entry[1], Transform),
               f"named_chain takes (name, Transform) pairs, got {entry!r}")
    _check(len(set(names)) == len(names), f"named_chain: duplicate names in {names}")

    def init(params: Params) -> dict[str, OptState]:
        return {n: t.init(params) for n, t in named}

    def update(updates: Updates, state: dict, params: Params | None = None,
               **extra: Any) -> tuple[Updates, dict]:
        if list(state) != names:
            raise ValueError(f"named_chain {names} got a state with keys {list(state)}; "
                             f"was the state made by this chain's init?")
        new_state = {}
        for n, t in named:
            updates, new_state[n] = t.update(updates, state[n], params, **extra)
        return updates, new_state

    return Transform(init, update)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``p + u`` leaf by leaf, cast back to each parameter's dtype."""
    return _map(lambda p, u: (p + u).to(p.dtype), params, updates)


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
        inv_coef = ((norm + 1e-6) / max_norm).clamp_min(1.0).reciprocal()
        return _map(lambda u: u * inv_coef, updates)

    return stateless(fn)


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


def scale_by_adam(b1: ScalarOrSchedule = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  bias_correction: bool = True) -> Transform:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)``, as this exact sequence of torch calls (a fused kernel
    mirrors it bit for bit)::

        m = m.mul(b1).add(g, alpha=1 - b1)
        v = v.mul(b2).addcmul(g, g, value=1 - b2)
        t = (count + 1).to(torch.float32)               # count: int64 0-d, applied steps before this one
        bc1 = 1 - b1 ** t; bc2 = 1 - b2 ** t            # float32 0-d; torch.ones(()) when not bias_correction
        u = (m / bc1) / (v.sqrt() / bc2.sqrt()).add(eps)

    The bias corrections are float32 0-d tensors on the params' device, as torch's capturable Adam computes them
    (no host sync); for ``b2 = 0.999`` ``bc2`` is then 1.3e-5 relative below its float64 value for the first ~1000
    steps (0.999 rounds up in float32), a ~6e-6 relative difference in those updates' size.

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
            t = count.to(torch.float32)
            bc1 = 1 - beta1 ** t
            bc2 = 1 - b2 ** t
        else:
            bc1 = bc2 = torch.ones((), dtype=torch.float32, device=count.device)
        bc2_sqrt = bc2.sqrt()
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


def scale_by_schedule(schedule: Schedule) -> Transform:
    """Multiply updates by ``schedule(count - 1)`` (the same t convention as :func:`scale_by_learning_rate`)."""

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(_zero_count(params))

    def update(updates: Updates, state: ScaleByScheduleState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, ScaleByScheduleState]:
        factor = _value_at(schedule, state.count)
        return _map(lambda u: u * factor, updates), ScaleByScheduleState(state.count + 1)

    return Transform(init, update)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> Transform:
    """``u = u * (-lr)``; ``lr`` is a float or a schedule evaluated at ``count - 1`` (DeepSpeed's t: the k-th
    applied step uses ``schedule(k - 1)``). The state records the lr used (:func:`current_lr`)."""
    _check(callable(lr) or lr >= 0, f"lr must be >= 0 or a schedule, got {lr!r}")

    def init(params: Params) -> ScheduleState:
        count = _zero_count(params)
        if callable(lr):
            return ScheduleState(count, _value_at(lr, count))
        return ScheduleState(count, torch.full((), float(lr), dtype=torch.float32, device=count.device))

    def update(updates: Updates, state: ScheduleState, params: Params | None = None,
               **extra: Any) -> tuple[Updates, ScheduleState]:
        step_lr = _value_at(lr, state.count) if callable(lr) else state.lr
        return _map(lambda u: u * (-step_lr), updates), ScheduleState(state.count + 1, step_lr)

    return Transform(init, update)


def adam(lr: ScalarOrSchedule = 1e-3, betas: Sequence[ScalarOrSchedule] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, bias_correction: bool = True, adam_w_mode: bool = True) -> Transform:
    """DeepSpeed's Adam: decoupled weight decay when ``adam_w_mode`` (DeepSpeed's default, = torch AdamW), else L2
    added to the gradient (torch.optim.Adam). State keys: ``weight_decay``, ``adam``, ``lr``."""
    b1, b2 = _check_betas(betas, "adam")
    decay = ("weight_decay", add_decayed_weights(weight_decay))
    direction = ("adam", scale_by_adam(b1, b2, eps, bias_correction))
    steps = [direction, decay] if adam_w_mode else [decay, direction]
    return named_chain(*steps, ("lr", scale_by_learning_rate(lr)))


def adamw(lr: ScalarOrSchedule = 1e-3, betas: Sequence[ScalarOrSchedule] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.0, bias_correction: bool = True) -> Transform:
    """Adam with decoupled weight decay (``adam(..., adam_w_mode=True)``)."""
    return adam(lr, betas, eps, weight_decay, bias_correction, adam_w_mode=True)


def lamb(lr: ScalarOrSchedule = 1e-3, betas: Sequence[ScalarOrSchedule] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, bias_correction: bool = True, max_coeff: float = 10.0,
         min_coeff: float = 0.01) -> Transform:
    """LAMB (You et al. 2019): ``r = adam direction + weight_decay * p``, ``p -= lr * ratio * r`` with the trust
    ratio ``||p|| / ||r||`` clamped to ``[min_coeff, max_coeff]`` as DeepSpeed's FusedLamb does (1 when either norm
    is 0). State keys: ``adam``, ``weight_decay``, ``trust_ratio``, ``lr``."""
    b1, b2 = _check_betas(betas, "lamb")
    return named_chain(("adam", scale_by_adam(b1, b2, eps, bias_correction)),
                       ("weight_decay", add_decayed_weights(weight_decay)),
                       ("trust_ratio", scale_by_trust_ratio(min_coeff, max_coeff)),
                       ("lr", scale_by_learning_rate(lr)))


def sgd(lr: ScalarOrSchedule = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False) -> Transform:
    """torch.optim.SGD: L2 weight decay, then momentum (:func:`trace`, omitted when ``momentum == 0``), then lr.
    State keys: ``weight_decay``, ``momentum`` (when used), ``lr``."""
    steps = [("weight_decay", add_decayed_weights(weight_decay))]
    if momentum != 0 or nesterov:
        steps.append(("momentum", trace(momentum, dampening, nesterov)))
    return named_chain(*steps, ("lr", scale_by_learning_rate(lr)))


def _inverse_time_decay(lr_decay: float) -> Schedule:
    def schedule(t: Tensor) -> Tensor:
        return (1.0 / (1.0 + (t + 1).to(torch.float64) * lr_decay)).to(torch.float32)

    return schedule


def adagrad(lr: ScalarOrSchedule = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
            initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> Transform:
    """torch.optim.Adagrad: L2 weight decay, ``g / (sqrt(sum g^2) + eps)``, times ``lr / (1 + k * lr_decay)`` at
    the k-th step (k = 0, 1, ...). State keys: ``weight_decay``, ``rss``, ``lr_decay`` (when used), ``lr``."""
    _check(lr_decay >= 0, f"lr_decay must be >= 0, got {lr_decay!r}")
    steps = [("weight_decay", add_decayed_weights(weight_decay)),
             ("rss", scale_by_rss(initial_accumulator_value, eps))]
    if lr_decay != 0:
        steps.append(("lr_decay", scale_by_schedule(_inverse_time_decay(lr_decay))))
    return named_chain(*steps, ("lr", scale_by_learning_rate(lr)))


# DeepSpeed params accepted for each optimizer type. torch_adam and fp32_optimizer_states pick an implementation in
# DeepSpeed (torch vs fused Adam; CPU-Adam state precision); the math here is the same and states are kept in the
# parameters' dtype (the step's fp32 master weights), so they are accepted and have no effect.
_OPTIMIZER_PARAMS = {
    "adam": ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam",
             "fp32_optimizer_states"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam",
              "fp32_optimizer_states"),
    "lamb": ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
}
_NO_EFFECT = ("torch_adam", "fp32_optimizer_states")


def optimizer_from_config(opt_cfg_type: str, params: Mapping[str, Any], schedule: Schedule | None,
                          *, momentum_schedule: Schedule | None = None) -> Transform:
    """Build a named optimizer from a DeepSpeed ``optimizer`` section.

    Args:
        opt_cfg_type: "adam", "adamw", "sgd", "lamb" or "adagrad" (case-insensitive). "adam" follows
            ``adam_w_mode`` (default True = decoupled); "adamw" is always decoupled, as in DeepSpeed.
        params: the section's ``params`` with DeepSpeed's names; missing ones take the defaults.
        schedule: the lr schedule, which replaces ``params["lr"]``; None keeps the constant lr.
        momentum_schedule: a ``betas[0]`` schedule (:func:`dsfunc.schedules.momentum_schedule_from_config`). For
            optimizers with betas it replaces beta1 and, as DeepSpeed's OneCycle does, sets beta2 to 0.99; others
            ignore it (DeepSpeed disables momentum cycling when the optimizer has no betas).
    """
    kind = opt_cfg_type.lower()
    if kind not in _OPTIMIZER_PARAMS:
        raise ValueError(f"unknown optimizer type {opt_cfg_type!r}; dsfunc supports {sorted(_OPTIMIZER_PARAMS)}")
    unknown = sorted(set(params) - set(_OPTIMIZER_PARAMS[kind]))
    if unknown:
        raise ValueError(f"optimizer {opt_cfg_type!r}: unknown parameter(s) {unknown}; valid parameters are "
                         f"{list(_OPTIMIZER_PARAMS[kind])}")
    kwargs = {k: v for k, v in params.items() if k not in _NO_EFFECT}
    if schedule is not None:
        kwargs["lr"] = schedule
    if momentum_schedule is not None and "betas" in _OPTIMIZER_PARAMS[kind]:
        kwargs["betas"] = (momentum_schedule, 0.99)
    if kind == "adamw":
        kwargs.pop("adam_w_mode", None)
        return adamw(**kwargs)
    return {"adam": adam, "lamb": lamb, "sgd": sgd, "adagrad": adagrad}[kind](**kwargs)


def current_lr(opt_state: OptState) -> Tensor | None:
    """The lr the last step used (float32 0-d), from the first :class:`ScheduleState` in ``opt_state``; None when
    there is none."""
    found = optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleState), none_is_leaf=False)
    for node in found:
        if isinstance(node, ScheduleState):
            return node.lr
    return None
