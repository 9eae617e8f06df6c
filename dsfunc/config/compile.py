"""The ``compile`` section: each unit's forward compiled with ``torch.compile`` (regional compilation).

``enabled``, ``backend`` and ``kwargs`` are the keys DeepSpeed documented for its torch.compile
integration (``kwargs`` go to ``torch.compile``); ``cuda_graph`` is dsfunc's: the whole step captured
once and replayed (:mod:`dsfunc.graphs`). DeepSpeed 0.19's DeepCompile keys are accepted only at their
defaults (dsfunc has no DeepCompile passes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _bool, _only, _string
from dsfunc.config.deepspeed_keys import COMPILE_DEFAULTS
from dsfunc.config.errors import _bad
from dsfunc.config.schema import _key, _section
from dsfunc.frozen import freeze


def _kwargs(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(path, value, 'a JSON object of torch.compile arguments, e.g. {"mode": "max-autotune"}')
    return freeze(value)


@dataclass(frozen=True)
class CompileConfig:
    """``compile``: whether, and how, each unit's forward is compiled."""

    enabled: bool = _key(False, _bool)
    """Compile each unit module's forward with torch.compile (regional compilation); the stage-3 gathers stay
    outside the compiled code.
    """
    backend: str = _key("inductor", _string)
    """The torch.compile backend."""
    kwargs: Mapping[str, Any] = _key(freeze({}), _kwargs)
    """Further torch.compile keyword arguments (e.g. {"mode": "max-autotune"}), frozen."""
    cuda_graph: bool = _key(False, _bool)
    """A dsfunc key: capture the whole step once as a CUDA graph and replay it (dsfunc.graphs); a step that
    cannot be captured runs eagerly and the log says why.
    """


_DEEPCOMPILE = "DeepSpeed's compiler (DeepCompile) options"
# DeepSpeed 0.19's keys of this section, each accepted at its default only (dsfunc has no DeepCompile passes)
_COMPILE_FIXED = {key: _only(default, feature=_DEEPCOMPILE) for key, default in COMPILE_DEFAULTS.items()}
_compile = _section(CompileConfig, _COMPILE_FIXED)


def parse_compile(section: Any) -> CompileConfig:
    """A ``compile`` section, validated and completed as inside a whole config."""
    return _compile(section, "compile")
