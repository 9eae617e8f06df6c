"""The ``compile`` section: each unit's forward, or the whole model's, compiled with ``torch.compile``.

``enabled``, ``backend`` and ``kwargs`` are the keys DeepSpeed documented for its torch.compile
integration (``kwargs`` go to ``torch.compile``); ``scope`` and ``cuda_graph`` are dsfunc's: what is
compiled (:mod:`dsfunc.compile`), and the whole step captured once and replayed (:mod:`dsfunc.graphs`). DeepSpeed 0.19's DeepCompile keys are accepted only at their
defaults (dsfunc has no DeepCompile passes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _bool, _choice, _only, _string
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
    """``compile``: whether, and how, the model's forward is compiled."""

    enabled: bool = _key(False, _bool)
    """Compile the forward with torch.compile, each unit's or the whole model's (``scope``)."""
    scope: str = _key("units", _choice("units", "model"))
    """A dsfunc key: what is compiled. "units": each unit module's forward (regional compilation, as torchtitan
    does); the model's own code around them (embeddings, final norm, output projection, a loss the model
    computes) runs eagerly, and ZeRO-3's gathers stay outside the compiled code. "model": the model's own
    forward as one graph, loss inside when the model returns it, so the compiler fuses the head with the
    loss (as torch.compile(model) does); not with ZeRO-3, whose gathers run inside that forward.
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
