"""Which layers each pipeline stage holds: ``parts[s]:parts[s + 1]`` of the layer list is stage ``s``'s.

The methods are DeepSpeed's, with its results: ``"uniform"`` gives every stage the same number of layers
(the first stages one more while some are left over); ``"parameters"`` balances the trainable parameter
count; ``"type:<regex>"`` balances the layers whose class name matches the regex (case-insensitive). A
balanced split minimises the spread between the heaviest and lightest stage (the linear partition problem),
taking the latest split point on ties.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dsfunc.errors import InputError


def partition_uniform(count: int, parts: int) -> list[int]:
    """Boundaries of ``count`` items over ``parts`` stages, as even as whole items allow."""
    if count <= parts:
        return [min(p, count) for p in range(parts + 1)]
    size, extra = divmod(count, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def partition_balanced(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries over ``parts`` stages whose weight sums differ the least (max minus min)."""
    n = len(weights)
    if n <= parts:
        return partition_uniform(n, parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[i][j]: (spread, heaviest, lightest) of the first i items over j stages; where[i][j]: the last cut
    best = [[(inf, inf, inf)] * (parts + 1) for _ in range(n + 1)]
    where = [[0] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf)
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                _, hi, lo = best[k][j - 1]
                if hi == inf:
                    continue
                part = prefix[i] - prefix[k]
                heaviest, lightest = max(hi, part), min(lo, part)
                if heaviest - lightest <= best[i][j][0]:
                    best[i][j] = (heaviest - lightest, heaviest, lightest)
                    where[i][j] = k
    cuts = [n]
    for j in range(parts, 0, -1):
        cuts.append(where[cuts[-1]][j])
    return cuts[::-1]


def partition(method: str, parts: int, names: Sequence[str], param_counts: Sequence[int]) -> list[int]:
    """Stage boundaries by ``method`` for layers with class ``names`` and trainable ``param_counts``.

    Every stage gets at least one layer (every split point lies between layers): fewer layers than stages is an
    error naming both.
    """
    if len(names) < parts:
        raise InputError(
            f"{len(names)} pipeline layers do not divide over {parts} stages: every stage needs at least one "
            f"layer; use at most {len(names)} stages or split the model into more layers"
        )
    kind = method.lower()
    if kind == "uniform":
        bounds = partition_uniform(len(names), parts)
    elif kind == "parameters":
        bounds = partition_balanced(param_counts, parts)
    elif kind.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        marks = [1 if pattern.search(name) else 0 for name in names]
        if not any(marks):
            raise InputError(f"partition_method {method!r} matches none of the layer classes {sorted(set(names))}")
        bounds = partition_balanced(marks, parts)
    else:
        raise InputError(
            f'partition_method {method!r} is not one of "parameters", "uniform" or "type:<class-name regex>"'
        )
    return bounds
