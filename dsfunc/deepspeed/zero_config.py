"""DeepSpeed's ZeRO config classes (``deepspeed.runtime.zero.config`` and ``.offload_config``), read by dsfunc's
one parser.

Scripts build ``DeepSpeedZeroConfig(**config["zero_optimization"])`` to read a config as DeepSpeed does:
here the keyword arguments are validated by :mod:`dsfunc.config.zero` (a bad key or value is a
:class:`~dsfunc.config.ConfigError`), and the attributes answer with DeepSpeed's field names and values
(``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``, the offload sections as objects, the
deprecated ``cpu_offload`` read as ``offload_optimizer``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from dsfunc.config.leaf_modules import DEFAULT_CLASSES, LeafModules, leaf_modules
from dsfunc.config.offload import OPTIMIZER_DEFAULTS, PARAM_DEFAULTS, offload_optimizer, offload_param
from dsfunc.config.zero import _ZERO_ALIASES, ZeroConfig, _zero, renamed_offload
from dsfunc.deepspeed.namespace import other_name
from dsfunc.frozen import thaw


class ZeroStageEnum(int, enum.Enum):
    """DeepSpeed's names of the ZeRO stages."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # noqa: PIE796 - DeepSpeed's alias of weights


class OffloadDeviceEnum(str, enum.Enum):
    """Where an offload section puts its tensors."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class _Offload:
    """An offload section, validated by dsfunc's parser, with DeepSpeed's fields (the given values over
    DeepSpeed's defaults)."""

    _DEFAULTS: Mapping[str, Any] = {}
    _PATH = ""

    def __init__(self, **values: Any) -> None:
        self._check(values, f"zero_optimization.{self._PATH}")
        fields = {"device": "none", "pin_memory": True, **self._DEFAULTS, **values}
        fields["device"] = OffloadDeviceEnum(fields["device"] or "none").value  # a str, as DeepSpeed keeps it
        self.__dict__.update(fields)

    @staticmethod
    def _check(values: Mapping[str, Any], path: str) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class DeepSpeedZeroOffloadParamConfig(_Offload):
    """``zero_optimization.offload_param``."""

    _DEFAULTS = PARAM_DEFAULTS
    _PATH = "offload_param"
    _check = staticmethod(offload_param)


class DeepSpeedZeroOffloadOptimizerConfig(_Offload):
    """``zero_optimization.offload_optimizer``; ``pipeline`` is DeepSpeed's "pipeline_read or pipeline_write"."""

    _DEFAULTS = OPTIMIZER_DEFAULTS
    _PATH = "offload_optimizer"
    _check = staticmethod(offload_optimizer)

    @property
    def pipeline(self) -> bool:
        return bool(self.pipeline_read or self.pipeline_write)


# DeepSpeed's field name -> dsfunc's key, where they differ
_FIELD = {short: key for short, key in _ZERO_ALIASES.items() if not short.startswith("stage3_")}
# DeepSpeed 0.19.8's defaults of the fields dsfunc accepts only at their default (dsfunc.config.zero._ZERO_FIXED)
_FIXED_DEFAULTS = {
    "use_multi_rank_bucket_allreduce": True, "load_from_fp32_weights": True, "elastic_checkpoint": False,
    "model_persistence_threshold": 2**63 - 1, "module_granularity_threshold": 0,
    "use_all_reduce_for_fetch_params": False, "allgather_sequential": False, "partition_stream_chunk_size": 0,
    "legacy_stage1": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
    "memory_efficient_linear": True, "override_module_apply": True, "pipeline_loading_checkpoint": False,
    "log_trace_cache_warnings": False, "enable_sanity_checks": False, "save_muon_momentum_buffer_in_memory": False,
    "zenflow": None,
}
DEFAULT_LEAF_MODULE_CLASSES = list(DEFAULT_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class DeepSpeedZeroLeafModuleConfig:
    """``zero_optimization.leaf_module`` (``deepspeed.runtime.zero.leaf_module_config``), read by dsfunc's parser,
    its fields as lists."""

    def __init__(self, **section: Any) -> None:
        self.leaves: LeafModules = leaf_modules(section, "zero_optimization.leaf_module")
        self.classes = list(self.leaves.classes)
        self.names = list(self.leaves.names)
        self.name_suffixes = list(self.leaves.name_suffixes)

    def __repr__(self) -> str:
        return f"DeepSpeedZeroLeafModuleConfig(classes={self.classes}, names={self.names}, suffixes={self.name_suffixes})"



class DeepSpeedZeroConfig:
    """``DeepSpeedZeroConfig(**zero_optimization)``: the section read by dsfunc's parser, with DeepSpeed's
    field names. ``zero`` is dsfunc's :class:`~dsfunc.config.ZeroConfig` of it."""

    def __init__(self, **section: Any) -> None:
        self._raw = renamed_offload(section, "zero_optimization")
        self.zero: ZeroConfig = _zero(section, "zero_optimization")
        self.offload_optimizer = _section(DeepSpeedZeroOffloadOptimizerConfig, self._raw.get("offload_optimizer"))
        self.offload_param = _section(DeepSpeedZeroOffloadParamConfig, self._raw.get("offload_param"))
        self.leaf_module = DeepSpeedZeroLeafModuleConfig(**thaw(self._raw.get("leaf_module") or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "zero":
            raise AttributeError(name)
        key = _FIELD.get(name, name)
        if key in ZeroConfig.__dataclass_fields__:
            return getattr(self.zero, key)
        spellings = [name, key, *(s for s, k in _ZERO_ALIASES.items() if k == key)]
        given = next((self._raw[s] for s in spellings if s in self._raw), None)
        if given is not None:
            return thaw(given)
        if name in _FIXED_DEFAULTS:
            return _FIXED_DEFAULTS[name]
        raise AttributeError(f"DeepSpeedZeroConfig has no field {name!r}")

    def __repr__(self) -> str:
        return f"DeepSpeedZeroConfig({self.zero!r})"


def _section(cls: type[_Offload], value: Any) -> _Offload | None:
    """An offload section given as an object (even an empty one, as DeepSpeed's), or None."""
    return None if value is None else cls(**thaw(value))



def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.zero.config`` (and ``.offload_config``) import, and refuse
    when used."""
    return other_name("runtime.zero.config", name)
