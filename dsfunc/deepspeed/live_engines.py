"""The engines alive in this process, so that DeepSpeed's per-parameter helpers
(``deepspeed.utils.safe_get_full_optimizer_state``, ...) find the state a parameter's optimizer state lives in."""

from __future__ import annotations

import weakref
from typing import Any

from dsfunc.errors import InputError

_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()


def register(engine: Any) -> None:
    _ENGINES.add(engine)


def unregister(engine: Any) -> None:
    _ENGINES.discard(engine)


def engine_of(workspace: Any) -> Any:
    """The live engine whose state's workspace is ``workspace``."""
    for engine in _ENGINES:
        if engine.state.program.run.workspace is workspace:
            return engine
    raise InputError("no live engine trains this parameter (the optimizer state lives in an engine's state)")
