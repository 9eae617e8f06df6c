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

from dsfunc.config.checks import _bool, _integer, _only, _string
from dsfunc.config.errors import _bad
from dsfunc.config.schema import Check, Rule, _key, _section
from dsfunc.frozen import freeze


def _kwargs(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(path, value, 'a JSON object of torch.compile arguments, e.g. {"mode": "max-autotune"}')
    return freeze(value)


@dataclass(frozen=True)
class CompileConfig:
    """``compile``: whether, and how, each unit's forward is compiled."""

    enabled: bool = _key(False, _bool)
    backend: str = _key("inductor", _string)
    kwargs: Mapping[str, Any] = _key(freeze({}), _kwargs)
    cuda_graph: bool = _key(False, _bool)  # dsfunc key: replay the whole step as a CUDA graph (dsfunc.graphs)


def _typed(check: Check) -> Rule:
    """A key that only tunes DeepCompile: with it off the value changes nothing, but it must be well-typed."""

    def rule(value: Any, path: str) -> None:
        check(value, path)

    return rule


_DEEPCOMPILE = "DeepCompile (DeepSpeed's compiler passes)"
_COMPILE_FIXED = {
    **{key: _only(False, feature=_DEEPCOMPILE) for key in (
        "deepcompile", "autoep_non_moe", "free_activation", "offload_activation", "offload_opt_states",
        "symmetric_memory", "offload_parameters", "keep_all_input_tensors")},
    **{key: _typed(_bool) for key in (
        "offload_activation_pin_memory", "double_buffer", "debug_log", "sync_before_reduce",
        "sync_after_reduce", "sync_before_allgather", "sync_after_allgather", "keep_int_input_tensors")},
    "free_activation_threshold": _typed(_integer(ge=0)),
    "passes": _only(None, feature=_DEEPCOMPILE),
}
_compile = _section(CompileConfig, _COMPILE_FIXED)


def parse_compile(section: Any) -> CompileConfig:
    """A ``compile`` section, validated and completed as inside a whole config."""
    return _compile(section, "compile")
