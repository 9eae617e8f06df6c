"""The ``tensor_parallel`` section and ``sequence_parallel_size``: the mesh's tp and sp axes
(:mod:`dsfunc.distributed.mesh`).

DeepSpeed's AutoTP training section (``runtime/tensor_parallel/config.py``, ``TPTrainingConfig``) holds
``autotp_size`` (0: off), ``partition_config`` (layer specs: parameter-name regexes and a partition type),
``preset_model`` (a built-in spec list), and keys that tune its own layers or inference; dsfunc reads the first
three (:mod:`dsfunc.parallel.autotp`) and applies them with ``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _accepted, _bool, _integer, _only, _optional, _string
from dsfunc.config.errors import _bad
from dsfunc.config.schema import _key, _section
from dsfunc.frozen import freeze

PRESETS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")  # DeepSpeed's AutoTPPresets


def _partition_config(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(path, value, 'an object {"layer_specs": [{"patterns": [...], "partition_type": "column"}, ...]}')
    return freeze(dict(value))


def _preset(value: Any, path: str) -> str:
    text = _string(value, path)
    if text.lower() not in PRESETS:
        raise _bad(path, value, "one of " + ", ".join(f'"{p}"' for p in PRESETS) + " (DeepSpeed's presets; give "
                   "partition_config layer_specs for other models)")
    return text.lower()


@dataclass(frozen=True)
class TensorParallelConfig:
    """``tensor_parallel``: the tensor-parallel ranks each layer is split over, and how to split it."""

    autotp_size: int = _key(0, _integer(ge=0))
    """Ranks per tensor-parallel group (0 or 1: no tensor parallelism). The world is split into autotp_size x the
    other axes; the config's batch sizes count the data-parallel ranks (world / autotp_size / ...).
    """
    partition_config: Mapping[str, Any] | None = _key(None, _optional(_partition_config))
    """DeepSpeed's layer specs: ``{"layer_specs": [{"patterns": [regex, ...], "partition_type": "column" | "row" |
    "skip"}], "use_default_specs": bool}``; a spec's regexes match parameter names (``...q_proj.weight``).
    """
    preset_model: str | None = _key(None, _optional(_preset))
    """One of DeepSpeed's built-in spec lists; dsfunc applies "llama" and "qwen2" (q/k/v/gate/up column, o/down row),
    the others split fused projections into sub-parameters, which dsfunc does not yet."""

    @property
    def size(self) -> int:
        """The mesh's tp axis."""
        return max(self.autotp_size, 1)


_FIXED = {
    "tp_overlap_comm": _only(False, feature="overlapping AutoTP's all-reduce with compute",
                             fix="torch's tensor parallel issues its collectives itself"),
    "tp": _accepted(_optional(lambda v, p: v)),  # inference-time TPConfig; AutoTP training reads autotp_size
    "tensor_parallel": _accepted(_optional(lambda v, p: v)),
    "dtype": _accepted(_optional(_string)),  # the compute dtype is the config's bf16/fp16
    "keep_module_on_host": _accepted(_bool),
    "injection_policy_tuple": _only(None, feature="AutoTP injection policies", fix="use partition_config"),
    "replace_with_kernel_inject": _only(False, feature="DeepSpeed's inference kernels"),
    "kernel_inject": _only(False, feature="DeepSpeed's inference kernels"),
}
_check = _section(TensorParallelConfig, _FIXED)


def _tensor_parallel(value: Any, path: str) -> TensorParallelConfig:
    return _check(value, path)


def parse_tensor_parallel(section: Any) -> TensorParallelConfig:
    """A ``tensor_parallel`` section, validated and completed as inside a whole config."""
    return section if isinstance(section, TensorParallelConfig) else _tensor_parallel(section, "tensor_parallel")
