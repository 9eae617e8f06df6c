"""The ``zero_optimization`` section: the ZeRO stage, its knobs, and the DeepSpeed features dsfunc lacks."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsfunc.config import deepspeed_keys as ds
from dsfunc.config.checks import (
    _SIZE,
    _accepted,
    _bool,
    _integer,
    _only,
    _optional,
    _removed,
    _without_effect_line,
)
from dsfunc.config.errors import ConfigError
from dsfunc.config.leaf_modules import LeafModules, leaf_modules
from dsfunc.config.offload import (
    OffloadConfig,
    offload_optimizer,
    offload_param,
    offload_without_effect,
    params_offloadable,
)
from dsfunc.config.schema import Rule, _key, _section

# DeepSpeed's deprecated boolean spellings of the offload sections (true means device "cpu"), read as those
DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def renamed_offload(section: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """``section`` with DeepSpeed's deprecated ``cpu_offload`` / ``cpu_offload_param`` (and
    ``cpu_offload_use_pin_memory``) written as the sections they stand for, as DeepSpeed reads them."""
    if not any(old in section for old in (*DEPRECATED_OFFLOAD, "cpu_offload_use_pin_memory")):
        return section
    out = {k: v for k, v in section.items() if k not in DEPRECATED_OFFLOAD and k != "cpu_offload_use_pin_memory"}
    pin = _optional(_bool)(section.get("cpu_offload_use_pin_memory"), f"{path}.cpu_offload_use_pin_memory")
    for old, new in DEPRECATED_OFFLOAD.items():
        if old not in section:
            continue
        if _optional(_bool)(section[old], f"{path}.{old}") and new in section:
            raise ConfigError(f'{path}.{old} and {path}.{new} are two spellings of the same setting '
                              f'({old} is DeepSpeed\'s deprecated one); keep "{new}".')
        if section[old]:
            out[new] = {"device": "cpu"} | ({} if pin is None else {"pin_memory": pin})
    return out


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: the ZeRO stage and its tuning knobs (sizes are in elements)."""

    stage: int = _key(0, _integer(ge=0, le=3))
    """The ZeRO stage, 0-3: 1 shards masters and optimizer state over the ranks, 2 gradients too, 3 the
    compute copies too (dsfunc.zero says what each rank holds)."""
    reduce_bucket_size: int = _key(500_000_000, _SIZE)
    """Elements per all-reduce of a stage-0 gradient (each unit's is reduced in chunks of this size). Stages
    1-3 reduce-scatter each unit whole, one collective per unit, where DeepSpeed reduces in buckets of this
    size.
    """
    allgather_bucket_size: int = _key(500_000_000, _SIZE)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): DeepSpeed all-gathers the
    updated stage 1-2 partitions in buckets of this many elements; dsfunc all-gathers each unit whole.
    """
    overlap_comm: bool = _key(None, _optional(_bool))
    """Unset (None) becomes true at stage 3, else false, as in DeepSpeed. dsfunc reads it only at stage 3,
    where false turns off prefetching the next unit's gather; gradient reductions overlap backward at every
    stage whatever its value.
    """
    contiguous_gradients: bool = _key(True, _bool)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): DeepSpeed copies gradients
    into a contiguous buffer as they are made; in dsfunc a unit's gradient always is one flat buffer.
    """
    reduce_scatter: bool = _key(True, _bool)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): DeepSpeed's false
    all-reduces and keeps this rank's part (the same numbers); dsfunc reduce-scatters at stages 1-3 and
    all-reduces at stage 0.
    """
    allgather_partitions: bool = _key(True, _bool)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): DeepSpeed 0.19.8 does not
    read it either (false once meant broadcasts instead of one all-gather).
    """
    stage3_prefetch_bucket_size: int = _key(50_000_000, _SIZE)
    """Elements. dsfunc reads only whether it is 0, which turns the stage-3 prefetch off; otherwise the next
    unit is gathered ahead (within stage3_max_live_parameters), where DeepSpeed prefetches up to this many
    elements.
    """
    stage3_param_persistence_threshold: int = _key(100_000, _SIZE)
    """Elements: a stage-3 unit smaller than this stays gathered between uses, like the root unit always does.
    Compared per unit, where DeepSpeed compares each parameter.
    """
    stage3_max_live_parameters: int = _key(1_000_000_000, _SIZE)
    """Elements: a prefetch does not start when it would take the gathered stage-3 units past this; the gather
    a forward or backward needs always runs.
    """
    stage3_max_reuse_distance: int = _key(1_000_000_000, _SIZE)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): DeepSpeed keeps a parameter
    gathered when it is used again within this many elements; dsfunc frees a unit after each use and gathers
    it again.
    """
    stage3_gather_16bit_weights_on_model_save: bool = _key(False, _bool)
    """At stage 3, whether the DeepSpeed engine's save_16bit_model gathers and saves the weights (false: it
    saves nothing and returns False, as DeepSpeed).
    """
    ignore_unused_parameters: bool = _key(True, _bool)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): a parameter no loss reached
    gets a zero gradient; DeepSpeed reads it only at stages 1-2 with the optimizer offloaded, where false
    stops the run.
    """
    sub_group_size: int = _key(1_000_000_000, _SIZE)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): DeepSpeed steps the
    optimizer in groups of this many elements; dsfunc holds masters and optimizer state as one flat shard per
    unit.
    """
    round_robin_gradients: bool = _key(False, _bool)
    """No effect in dsfunc (said once at start-up if given; zero.WITHOUT_EFFECT): DeepSpeed reorders stage 1-2
    gradients so the copies to the host spread over ranks; in dsfunc each rank holds 1/world of every unit
    already.
    """
    offload_optimizer: OffloadConfig | None = _key(None, offload_optimizer)  # noqa: RUF009
    """None: off. Else the fp32 masters and optimizer state live in host memory and the update runs on the CPU
    (stages 1-3).
    """
    offload_param: OffloadConfig | None = _key(None, offload_param)  # noqa: RUF009
    """None: off. Else (stage 3, with offload_optimizer) the 16-bit parameter shards stay in host memory and
    stream to the device for each gather.
    """
    leaf_module: LeafModules = _key(LeafModules(), leaf_modules)  # noqa: RUF009
    """The modules marked as leaves (:mod:`dsfunc.zero.leaf`) when the state is built, at every stage as in
    DeepSpeed: by default Hugging Face's Mixtral and Qwen MoE blocks."""

    def __post_init__(self) -> None:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        # DeepSpeed ignores offload below the stage that can use it (said at start-up: offload_without_effect)
        if self.stage == 0:
            object.__setattr__(self, "offload_optimizer", None)
        if self.stage < 3:
            object.__setattr__(self, "offload_param", None)
        object.__setattr__(self, "offload_param", params_offloadable(self.offload_optimizer, self.offload_param))


_ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    # deprecated name:
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "partition_stream_chunk_size": "stage3_partition_stream_chunk_size",
}
_ZERO_FIXED: dict[str, Rule] = {
    "zenflow": _only(None, feature="ZenFlow"),
    "use_multi_rank_bucket_allreduce": _only(True, feature="disabling multi-rank bucket all-reduce"),
    "load_from_fp32_weights": _only(
        True, feature="rebuilding fp32 master weights from 16-bit checkpoint weights"
    ),
    "elastic_checkpoint": _accepted(_bool),  # dsfunc checkpoints always reshard (WITHOUT_EFFECT)
    "stage3_model_persistence_threshold": _only(sys.maxsize, feature="a model persistence threshold"),
    "stage3_module_granularity_threshold": _accepted(_integer(ge=0)),  # tunes fetching (WITHOUT_EFFECT)
    "stage3_use_all_reduce_for_fetch_params": _only(False, feature="all-reduce parameter fetching"),
    "stage3_allgather_sequential": _only(False, feature="sequential all-gathers"),
    "stage3_partition_stream_chunk_size": _only(0, feature="streamed parameter partitioning"),
    "legacy_stage1": _only(False, feature="the legacy ZeRO stage 1 implementation"),
    "zero_hpz_partition_size": _only(1, feature="ZeRO++ hierarchical partitioning (hpZ)"),
    "zero_quantized_weights": _only(False, feature="ZeRO++ quantized weights"),
    "zero_quantized_nontrainable_weights": _only(False, feature="ZeRO++ quantized non-trainable weights"),
    "zero_quantized_gradients": _only(False, feature="ZeRO++ quantized gradients"),
    # DeepSpeed's ZeRO-3 patches of torch.nn.functional.linear and nn.Module.apply (under zero.Init); dsfunc
    # patches neither, so either value describes it (DeepSpeed-Chat sets memory_efficient_linear: false)
    "memory_efficient_linear": _bool,
    "override_module_apply": _bool,
    "pipeline_loading_checkpoint": _only(False, feature="pipeline-mode checkpoint loading"),
    "log_trace_cache_warnings": _only(False, feature="trace-cache warnings"),
    "enable_sanity_checks": _only(False, feature="DeepSpeed's internal sanity checks"),
    "save_muon_momentum_buffer_in_memory": _only(False, feature="the Muon optimizer"),
} | {key: _removed(message, ds.REMOVED_SEE) for key, message in ds.REMOVED_ZERO.items()}


_ZERO_SECTION = _section(ZeroConfig, _ZERO_FIXED, _ZERO_ALIASES)

# DeepSpeed keys dsfunc parses (a bad value is an error) but that tune machinery it does not have. They are
# not errors, since configs copied from tutorials set them to their defaults; a config that sets any of
# them is told so once at start-up (:func:`dsfunc.config.announce_without_effect`), with these reasons.
WITHOUT_EFFECT = {
    "allgather_bucket_size": (
        "each unit's updated shards are all-gathered whole, one collective per unit: no buckets"
    ),
    "contiguous_gradients": "a unit's gradient always arrives as one flat contiguous buffer",
    "reduce_scatter": (
        "gradients are always reduce-scattered at stages 1-3 and all-reduced at stage 0; DeepSpeed's false "
        "(all-reduce, then keep this rank's part) gives the same numbers"
    ),
    "allgather_partitions": (
        "DeepSpeed 0.19.8 does not read it either; updated shards are always all-gathered"
    ),
    "stage3_max_reuse_distance": (
        "a stage-3 unit is freed after its forward and gathered again for its backward, prefetched one unit "
        "ahead within stage3_max_live_parameters"
    ),
    "ignore_unused_parameters": (
        "a parameter no loss reached gets a zero gradient, never an error; DeepSpeed 0.19.8 reads it only at "
        "stages 1-2 with the optimizer offloaded, where false stops the run at such a parameter"
    ),
    "sub_group_size": (
        "masters and optimizer state are one flat shard per unit: there are no sub-groups to size"
    ),
    "round_robin_gradients": (
        "every rank holds 1/world of every unit, so the gradient copies to the host are already spread evenly"
    ),
    "elastic_checkpoint": (
        "dsfunc checkpoints always load at any data-parallel size and ZeRO stage, as DeepSpeed's elastic ones at "
        "stages 1-2 (DeepSpeed deprecates the key at stage 3)"
    ),
    "stage3_module_granularity_threshold": (
        "DeepSpeed fetches the parameters of modules smaller than this as one leaf; dsfunc gathers each unit "
        "whole, one collective per unit"
    ),
}


def without_effect(section: Any) -> list[str]:
    """The start-up lines naming the keys of a raw ``zero_optimization`` section (as spelled there) that have
    no effect in dsfunc, with why: those of :data:`WITHOUT_EFFECT`, and offload below the stage that uses it."""
    if not isinstance(section, Mapping):
        return []
    lines = [_without_effect_line("zero_optimization", section, WITHOUT_EFFECT, _ZERO_ALIASES),
             offload_without_effect(renamed_offload(section, "zero_optimization"))]
    return [line for line in lines if line]


def _zero(value: Any, path: str) -> ZeroConfig:
    if isinstance(value, bool):  # legacy "zero_optimization": true|false = stage 1|0
        return ZeroConfig(stage=int(value))
    return _ZERO_SECTION(renamed_offload(value, path) if isinstance(value, Mapping) else value, path)
