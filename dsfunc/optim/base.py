"""The optax pattern: an update transform is a pair of pure functions ``(init, update)`` over pytrees.

``init(params)`` returns the optimizer state (NamedTuples, tuples and dicts of tensors; step counters are
int64 0-d tensors on the params' device), and ``update(updates, state, params=None, **extra) ->
(updates, state)`` returns new values without touching its inputs. Every transform ignores extras it
does not know, so a step can pass e.g. ``grad_scale``, ``global_norm`` and ``segment_norm`` to a whole
chain. Nothing here reads a tensor back to the host or branches on a tensor's value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from dsfunc.errors import InputError
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
        raise InputError(f"{who} needs the parameters: call update(updates, state, params)")
    return params


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message)


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
            raise InputError(f"chain of {len(transforms)} transforms got a state of {len(state)} entries; "
                             f"was the state made by this chain's init?")
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    return Transform(init, update)


def named_chain(*named: tuple[str, Transform]) -> Transform:
    """Apply the transforms in order; the state is a dict ``name -> state``.

    >>> from dsfunc.optim import clip_by_global_norm, sgd
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
            raise InputError(f"named_chain {names} got a state with keys {list(state)}; "
                             f"was the state made by this chain's init?")
        new_state = {}
        for n, t in named:
            updates, new_state[n] = t.update(updates, state[n], params, **extra)
        return updates, new_state

    return Transform(init, update)


class ByLabel(dict):
    """An extra of :func:`multi_transform`'s ``update`` whose value differs per label: each label's
    transform gets its own entry (None where the label has none)."""


def multi_transform(transforms: Mapping[str, Transform], labels: Mapping[str, str] | Callable[[str], str]) -> Transform:
    """optax's ``multi_transform`` over a flat mapping: each key's label picks the transform that updates
    it (a step's keys are its units, each holding one parameter group). The state is ``{label: state}``.

    >>> from dsfunc.optim import sgd
    >>> tx = multi_transform({"decay": sgd(lr=0.1, weight_decay=0.5), "none": sgd(lr=0.1)},
    ...                      lambda key: "none" if key.endswith("bias") else "decay")
    >>> params = {"w": torch.ones(2), "bias": torch.ones(2)}
    >>> updates, _ = tx.update({k: torch.zeros(2) for k in params}, tx.init(params), params)
    >>> updates["w"].tolist(), updates["bias"].abs().tolist()
    ([-0.05000000074505806, -0.05000000074505806], [0.0, 0.0])
    """
    label_of = labels.__getitem__ if isinstance(labels, Mapping) else labels

    def split(tree: Any, label: str) -> Any:
        return None if tree is None else {k: v for k, v in tree.items() if label_of(k) == label}

    def init(params: Params) -> dict[str, OptState]:
        unknown = sorted({label_of(k) for k in params} - set(transforms))
        _check(not unknown, f"multi_transform: labels {unknown} have no transform; transforms are {sorted(transforms)}")
        return {label: t.init(split(params, label)) for label, t in transforms.items()}

    def update(updates: Updates, state: dict, params: Params | None = None,
               **extra: Any) -> tuple[Updates, dict]:
        out, new_state = {}, {}
        for label, t in transforms.items():
            mine = {k: v.get(label) if isinstance(v, ByLabel) else v for k, v in extra.items()}
            part, new_state[label] = t.update(split(updates, label), state[label], split(params, label), **mine)
            out.update(part)
        return {k: out[k] for k in updates}, new_state

    return Transform(init, update)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``p + u`` leaf by leaf, cast back to each parameter's dtype."""
    return _map(lambda p, u: (p + u).to(p.dtype), params, updates)
