"""Parameters, gradients and runners shared by the optimizer tests (dsfunc against torch.optim)."""

from __future__ import annotations

import math

import optree
import torch

from dsfunc.optim import (
    Transform,
    apply_updates,
)

STEPS = 20
SHAPES = {"w": (7, 5), "b": (5,), "nested": {"k": (2, 3, 4), "s": (1,)}}


def make_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda shape: torch.randn(shape, generator=g), SHAPES,
                           is_leaf=lambda x: isinstance(x, tuple))


def make_grads(seed: int = 1) -> list[dict]:
    return [make_params(seed + 100 * k) for k in range(STEPS)]


def run_ours(tx: Transform, params: dict, grads: list[dict], **extra) -> tuple[dict, object]:
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params, **extra)
        params = apply_updates(params, updates)
    return params, state


def run_torch(make_opt, params: dict, grads: list[dict], before_step=None) -> dict:
    leaves, spec = optree.tree_flatten(params)
    tparams = [torch.nn.Parameter(x.clone()) for x in leaves]
    opt = make_opt(tparams)
    for k, g in enumerate(grads):
        for p, gl in zip(tparams, optree.tree_leaves(g)):
            p.grad = gl.clone()
        if before_step is not None:
            before_step(opt, k)
        opt.step()
    return optree.tree_unflatten(spec, [p.detach() for p in tparams])


def max_rel_diff(a: dict, b: dict) -> float:
    """max over leaves of max|a - b| / max|b|."""
    diffs = optree.tree_map(lambda x, y: ((x - y).abs().max() / y.abs().max()).item(), a, b)
    return max(optree.tree_leaves(diffs))


def assert_moved(before: dict, after: dict, at_least: float = 1e-3) -> None:
    """Guard against a comparison that passes because nothing happened."""
    assert max_rel_diff(after, before) > at_least


def warmup_lr_formula(t: int, lo: float, hi: float, n: int) -> float:
    """DeepSpeed WarmupLR (log), written out: lr used by the step after the scheduler reached t."""
    if t < 0:
        return lo
    gamma = math.log(t + 1) / math.log(n) if t < n else 1.0
    return lo + (hi - lo) * gamma
