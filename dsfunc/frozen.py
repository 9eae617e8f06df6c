"""One immutable mapping for the whole package: the parsed config's sections and the state's tensors.

:class:`FrozenDict` is a ``dict`` (so it is JSON-serialisable, picklable and usable as ``**kwargs``) that
refuses every change, hashes by its items, and is an optree node whose keys are static: ``tree_map`` over
a state maps its values and keeps the keys and their order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree

from dsfunc.errors import InputTypeError

# registrations here are visible to plain optree.tree_map, without a namespace argument
GLOBAL_NAMESPACE = getattr(optree.registry, "__GLOBAL_NAMESPACE")


class FrozenDict(dict):
    """An insertion-ordered, immutable, hashable ``dict``."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise InputTypeError(
            "FrozenDict is immutable: build a new dict instead; for a TrainState use "
            "state.replace(...), e.g. state.replace(params={**state.params, key: value})"
        )

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse()

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple:
        return (type(self), (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


optree.register_pytree_node(
    FrozenDict,
    lambda d: (tuple(d.values()), tuple(d.keys()), tuple(d.keys())),
    lambda keys, values: FrozenDict(zip(keys, values)),
    namespace=GLOBAL_NAMESPACE,
)


def freeze(value: Any) -> Any:
    """Mappings become FrozenDicts and lists tuples, recursively."""
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Plain dicts (with string keys) and lists, recursively: ready for ``json.dumps``."""
    if isinstance(value, Mapping):
        return {str(k): thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value
