"""The batch triple: DeepSpeed's inference of train batch, micro batch and accumulation steps.

Every error prints the three values, the world size and the rule, and lists values that would work.
"""

from __future__ import annotations

import math
from typing import Any

from dsfunc.config.errors import ConfigError, _bad, _or

_RULE = "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"


def _report(t: int | None, m: int | None, g: int | None, w: int) -> str:
    def show(v: int | None) -> str:
        return "not set" if v is None else str(v)

    return (
        f"\n  train_batch_size = {show(t)}\n  train_micro_batch_size_per_gpu = {show(m)}"
        f"\n  gradient_accumulation_steps = {show(g)}\n  world_size = {w} (data-parallel ranks)"
        f"\nRule: {_RULE}."
    )


def _multiples_near(x: int, k: int) -> list[int]:
    low = x // k * k
    return [v for v in (low, low + k) if v > 0]


def _divisors_near(n: int, target: int, count: int = 4) -> list[int]:
    divisors = {d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}
    return sorted(sorted(divisors, key=lambda d: (abs(d - target), d))[:count])


def _suggest(lines: list[str]) -> str:
    return "\nValues that would work:" + "".join(f"\n  - {line}" for line in lines)


def _not_divisible(
    derived: str,
    t: int,
    k: int,
    product: str,
    m: int | None,
    g: int | None,
    w: int,
    vary: tuple[str, int] | None,
) -> ConfigError:
    """``t`` is not a multiple of ``k`` (= ``product``), so ``derived`` cannot be derived.

    ``vary`` names the given key (and its value) that could change instead of train_batch_size.
    """
    trains = _multiples_near(t, k)
    lines = [f"train_batch_size = {_or(trains)} ({derived} {_or([v // k for v in trains])})"]
    if vary is not None and t % w == 0:
        name, current = vary
        lines.append(
            f"{name} = {_or(_divisors_near(t // w, current))} (divisors of train_batch_size / world_size "
            f"= {t // w})"
        )
    return ConfigError(
        f"Cannot derive {derived}: train_batch_size = {t} is not divisible by {product} = {k}."
        + _report(t, m, g, w)
        + _suggest(lines)
    )


def _mismatch_message(t: int, m: int, g: int, w: int) -> str:
    lines = [f"train_batch_size = {m * g * w} (keeping micro batch and accumulation steps)"]
    if t % (m * w) == 0:
        lines.append(f"gradient_accumulation_steps = {t // (m * w)} (keeping train batch and micro batch)")
    if t % (g * w) == 0:
        lines.append(
            f"train_micro_batch_size_per_gpu = {t // (g * w)} (keeping train batch and accumulation steps)"
        )
    lines.append("or leave one of the three out and dsfunc derives it")
    return (
        f"Inconsistent batch sizes: train_batch_size must equal train_micro_batch_size_per_gpu * "
        f"gradient_accumulation_steps * world_size, but {t} != {m} * {g} * {w} = {m * g * w}."
        + _report(t, m, g, w)
        + _suggest(lines)
    )


def _derive(derived: str, t: int, given: tuple[str, int], m: int | None, g: int | None, w: int) -> int:
    """``derived`` = train_batch_size / (the ``given`` key's value * world_size), when that divides."""
    name, k = given
    if t % (k * w):
        raise _not_divisible(derived, t, k * w, f"{name} * world_size = {k} * {w}", m, g, w, vary=given)
    return t // (k * w)


def _check_triple(t: int, m: int, g: int, w: int) -> None:
    """The rule the three values must satisfy, however they were given."""
    if t != m * g * w:
        raise ConfigError(_mismatch_message(t, m, g, w))


def _resolve_batch(t: int | None, m: int | None, g: int | None, w: int) -> tuple[int, int, int]:
    """DeepSpeed's six-way inference of (train_batch_size, micro batch, accumulation steps)."""
    if t is None and m is None:
        raise ConfigError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided: set "
            "train_micro_batch_size_per_gpu (samples per rank per forward/backward), optionally with "
            "gradient_accumulation_steps, or set train_batch_size (samples per optimizer step, all ranks)."
            + _report(t, m, g, w)
        )
    if t is not None and m is not None and g is None:
        g = _derive("gradient_accumulation_steps", t, ("train_micro_batch_size_per_gpu", m), m, g, w)
    elif t is not None and g is not None and m is None:
        m = _derive("train_micro_batch_size_per_gpu", t, ("gradient_accumulation_steps", g), m, g, w)
    elif t is not None and m is None:
        if t % w:
            raise _not_divisible("train_micro_batch_size_per_gpu", t, w, "world_size", m, g, w, vary=None)
        g, m = 1, t // w
    elif t is None:
        g = 1 if g is None else g
        t = m * g * w
    _check_triple(t, m, g, w)
    return t, m, g


def _batch_size(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(path, value, "a positive integer")
    return value


def _world_size(world_size: int | None) -> int:
    if world_size is None:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size = {world_size!r} is invalid: expected a positive integer.")
    return world_size
