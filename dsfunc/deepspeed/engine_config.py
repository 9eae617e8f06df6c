"""DeepSpeed's config accessors on the engine (``engine.zero_optimization_stage()``, ``engine.fp16_enabled()``,
``engine.flops_profiler_enabled()``, ...), answered from the parsed :class:`~dsfunc.config.Config`.

Scripts and libraries read the config through these methods rather than the JSON, so every accessor of
DeepSpeed 0.19's ``DeepSpeedEngine`` answers with what DeepSpeed would return for the same config.
Sections dsfunc accepts only switched off (autotuning, data efficiency, ...; see
:mod:`dsfunc.config.unsupported`) answer with DeepSpeed's values for "off", which are the only ones
such a config can hold. ``tests/deepspeed/test_engine_surface.py`` compares every accessor with a real
DeepSpeed engine built from the same config.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dsfunc.config import Config
from dsfunc.config.dtypes import DTYPES
from dsfunc.config.offload import OffloadConfig
from dsfunc.frozen import thaw

_LOWER_CASE_OPTIMIZERS = {"adam", "adamw", "lamb", "adagrad", "muon"}  # DeepSpeed's own: named in lower case

# What DeepSpeed 0.19.8 returns for the sections a dsfunc config can only hold switched off
_OFF = {
    "autotp_size": 0,
    "autotuning_enabled": False,
    "autotuning_start_profile_step": 3,
    "autotuning_end_profile_step": 5,
    "autotuning_metric": "throughput",
    "autotuning_profile_model_info": False,
    "fp16_master_weights_and_gradients": False,
    "checkpoint_serialization_enabled": True,
    "checkpoint_writer_enabled": False,
    "use_node_local_storage": False,
    "load_universal_checkpoint": False,
    "curriculum_learning_enabled": False,
    "curriculum_learning_config": {"enabled": False},
    "data_efficiency_enabled": False,
    "data_sampling_enabled": False,
    "random_ltd_enabled": False,
    "random_ltd_config": {"enabled": False, "layer_token_lr_schedule": {"enabled": False}},
    "dump_state": False,
    "memory_breakdown": False,
    "log_level": None,
    "torch_autocast_enabled": False,
    "torch_autocast_dtype": None,
    "zenflow_config": None,
    "zero_legacy_stage1": False,
    "zero_elastic_checkpoint": False,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "zero_nvme_offload_optimizer": False,
    "zero_partial_offload": 1.0,
    "zero_module_granularity_threshold": 0,
    "zero_model_persistence_threshold": 2**63 - 1,
    "zero_log_trace_cache_warnings": False,
    "zero_allgather_sequential": False,
    "zero_multi_rank_bucket_allreduce": True,
    "zero_parameter_alignment": False,
    "zero_save_muon_momentum_buffer_in_memory": False,
    "zero_load_from_fp32_weights": True,
    "zero_compute_grad_norm": True,
    "zero_force_ds_cpu_optimizer": True,
    "optimizer_legacy_fusion": False,
    "super_offload": False,
    "compile_autosp": False,
    "compile_autotp": False,
    "cpuadam_cores_perc": 0.9,
    "is_sanity_checks_enabled": False,
    "is_deepcompile_enabled": False,
    "is_deepcompile_active": False,
    "uses_parallelization_pass_only": False,
}


def _zero(name: str) -> Any:
    return lambda cfg: getattr(cfg.zero_optimization, name)


# accessor -> its value, from dsfunc's parsed config
_FROM_CONFIG = {
    "train_batch_size": lambda cfg: cfg.train_batch_size,
    "train_micro_batch_size_per_gpu": lambda cfg: cfg.train_micro_batch_size_per_gpu,
    "gradient_accumulation_steps": lambda cfg: cfg.gradient_accumulation_steps,
    "gradient_clipping": lambda cfg: cfg.gradient_clipping,
    "steps_per_print": lambda cfg: cfg.steps_per_print,
    "wall_clock_breakdown": lambda cfg: cfg.wall_clock_breakdown,
    "flops_profiler_enabled": lambda cfg: cfg.flops_profiler.enabled,
    "flops_profiler_profile_step": lambda cfg: cfg.flops_profiler.profile_step,
    "flops_profiler_module_depth": lambda cfg: cfg.flops_profiler.module_depth,
    "flops_profiler_top_modules": lambda cfg: cfg.flops_profiler.top_modules,
    "flops_profiler_detailed": lambda cfg: cfg.flops_profiler.detailed,
    "flops_profiler_output_file": lambda cfg: cfg.flops_profiler.output_file,
    "flops_profiler_recompute_fwd_factor": lambda cfg: cfg.flops_profiler.recompute_fwd_factor,
    "dataloader_drop_last": lambda cfg: cfg.dataloader_drop_last,
    "managed_gradient_accumulation": lambda cfg: cfg.managed_gradient_accumulation,
    "checkpoint_tag_validation_enabled": lambda cfg: cfg.checkpoint.tag_validation != "IGNORE",
    "checkpoint_tag_validation_fail": lambda cfg: cfg.checkpoint.tag_validation == "FAIL",
    "postscale_gradients": lambda cfg: not cfg.prescale_gradients,
    "gradient_predivide_factor": lambda cfg: cfg.gradient_predivide_factor,
    "zero_allow_untested_optimizer": lambda cfg: cfg.zero_allow_untested_optimizer,
    "fp16_enabled": lambda cfg: cfg.fp16.enabled,
    "fp16_auto_cast": lambda cfg: cfg.fp16.auto_cast,
    "bfloat16_enabled": lambda cfg: cfg.bf16.enabled,
    "bf16_master_weights_and_gradients": lambda cfg: cfg.bf16.bf16_master_weights_and_grads,
    "bf16_optimizer_states": lambda cfg: cfg.bf16.bf16_optimizer_states,
    "loss_scale": lambda cfg: cfg.fp16.loss_scale,
    "dynamic_loss_scale": lambda cfg: cfg.fp16.loss_scale == 0,
    "initial_dynamic_scale": lambda cfg: 2**cfg.fp16.initial_scale_power,
    "dynamic_loss_scale_args": lambda cfg: {
        "init_scale": 2**cfg.fp16.initial_scale_power,
        "scale_window": cfg.fp16.loss_scale_window,
        "delayed_shift": cfg.fp16.hysteresis,
        "consecutive_hysteresis": cfg.fp16.consecutive_hysteresis,
        "min_scale": cfg.fp16.min_loss_scale,
    },
    "get_data_types": lambda cfg: (
        cfg.compute_dtype,
        DTYPES[cfg.grad_accum_dtype] if cfg.grad_accum_dtype else cfg.compute_dtype,
    ),
    "optimizer_params": lambda cfg: _thawed(cfg.raw.get("optimizer", {}).get("params")),
    "scheduler_name": lambda cfg: cfg.scheduler.type if cfg.scheduler else None,
    "scheduler_params": lambda cfg: _thawed(cfg.raw.get("scheduler", {}).get("params")),
    "aio_config": lambda cfg: {**_AIO_DEFAULTS, **_thawed(cfg.raw.get("aio", {}))},
    "zero_optimization_stage": _zero("stage"),
    "zero_optimization": lambda cfg: cfg.zero_optimization.stage > 0,
    "zero_optimization_partition_gradients": lambda cfg: cfg.zero_optimization.stage >= 2,
    "zero_optimization_partition_weights": lambda cfg: cfg.zero_optimization.stage == 3,
    "is_first_weights_partition_group": lambda cfg: cfg.zero_optimization.stage == 3,
    "zero_reduce_bucket_size": _zero("reduce_bucket_size"),
    "zero_allgather_bucket_size": _zero("allgather_bucket_size"),
    "zero_overlap_comm": lambda cfg: bool(cfg.zero_optimization.overlap_comm),
    "zero_contiguous_gradients": _zero("contiguous_gradients"),
    "zero_reduce_scatter": _zero("reduce_scatter"),
    "zero_allgather_partitions": _zero("allgather_partitions"),
    "zero_prefetch_bucket_size": _zero("stage3_prefetch_bucket_size"),
    "zero_param_persistence_threshold": _zero("stage3_param_persistence_threshold"),
    "zero_max_live_parameters": _zero("stage3_max_live_parameters"),
    "zero_max_reuse_distance": _zero("stage3_max_reuse_distance"),
    "zero_gather_16bit_weights_on_model_save": _zero("stage3_gather_16bit_weights_on_model_save"),
    "zero_ignore_unused_parameters": _zero("ignore_unused_parameters"),
    "zero_sub_group_size": _zero("sub_group_size"),
    "zero_round_robin_gradients": _zero("round_robin_gradients"),
    "zero_offload_optimizer": _zero("offload_optimizer"),
    "zero_offload_param": _zero("offload_param"),
    "zero_cpu_offload": lambda cfg: _on_host(cfg.zero_optimization.offload_optimizer),
    "zero_use_cpu_optimizer": lambda cfg: _on_host(cfg.zero_optimization.offload_optimizer),
    "autotuning_metric_path": lambda cfg: os.path.join(os.getcwd(), "autotuning_metric.json"),
    "autotuning_model_info_path": lambda cfg: os.path.join(os.getcwd(), "autotuning_model_info.json"),
}

_AIO_DEFAULTS = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                 "overlap_events": True, "use_gds": False}


def _thawed(value: Any) -> Any:
    """The frozen raw config as plain dicts and lists (what DeepSpeed's accessors hand out)."""
    return None if value is None else thaw(value)


def _on_host(offload: OffloadConfig | None) -> bool:
    return offload is not None and offload.device in ("cpu", "nvme")


def _accessor(name: str, read: Any) -> Any:
    def accessor(self: ConfigAccessors) -> Any:
        return read(self.state.program.config)

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = f"DeepSpeed's ``engine.{name}()``, from the config."
    return accessor


def _constant(name: str, value: Any) -> Any:
    def accessor(self: ConfigAccessors) -> Any:
        return value

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = f"DeepSpeed's ``engine.{name}()``: its value with the feature off (dsfunc has no other)."
    return accessor


class ConfigAccessors:
    """DeepSpeed's config accessors, one method per name in DeepSpeed's engine (mixed into the engine)."""

    state: Any  # the engine's current TrainState

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (DeepSpeed's property: the compute dtype when unset; dsfunc
        reduces in fp32 then, see ``communication_data_type`` in the config)."""
        cfg: Config = self.state.program.config
        return DTYPES[cfg.communication_data_type] if cfg.communication_data_type else torch.float32

    def optimizer_name(self) -> str | None:
        """The config's optimizer type (lower case, as DeepSpeed), or the class name of the client optimizer."""
        client = getattr(self, "client_optimizer", None)
        if client is not None:
            return type(client).__name__
        cfg: Config = self.state.program.config
        if cfg.optimizer is None:
            return None
        given = cfg.raw.get("optimizer", {}).get("type", cfg.optimizer.type)
        return given.lower() if given.lower() in _LOWER_CASE_OPTIMIZERS else given

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        cfg: Config = self.state.program.config
        return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


for _name, _read in _FROM_CONFIG.items():
    setattr(ConfigAccessors, _name, _accessor(_name, _read))
for _name, _value in _OFF.items():
    setattr(ConfigAccessors, _name, _constant(_name, _value))
del _name, _read, _value
