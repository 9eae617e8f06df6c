"""DeepSpeed 0.19.8's own tables of the sections dsfunc accepts only switched off, and what it removed.

Read from DeepSpeed's config classes (``comm/config.py``,
``runtime/swap_tensor/constants.py``, ``runtime/config.py``,
``compile/config.py``, ``autotuning/constants.py``, ``runtime/data_pipeline/constants.py``,
``runtime/zero/offload_config.py``), so that a typo or a wrong type inside them is an error naming the key,
as everywhere else in the config. ``tests/config/test_unsupported.py`` checks that real DeepSpeed accepts
what these tables accept.
"""

from __future__ import annotations

from dsfunc.config.checks import _bool, _fields, _integer, _list_of, _number, _object, _optional, _string

_ENABLED = {"enabled": _optional(_bool)}
_INT = _integer()
_COUNT = _integer(ge=0)
_STR = _optional(_string)

AIO = {  # tunes NVMe I/O, which only offload to NVMe (refused) uses: any valid value is accepted
    "block_size": _COUNT,
    "queue_depth": _COUNT,
    "intra_op_parallelism": _COUNT,
    "single_submit": _bool,
    "overlap_events": _bool,
    "use_gds": _bool,
}

COMMS_LOGGER = {"prof_all": _bool, "prof_ops": _list_of(_string), "verbose": _bool, "debug": _bool}

TORCH_AUTOCAST = {"dtype": _STR, "lower_precision_safe_modules": _optional(_list_of(_string))}

HYBRID_ENGINE = {
    "max_out_tokens": _INT,
    "inference_tp_size": _INT,
    "release_inference_cache": _bool,
    "pin_parameters": _bool,
    "tp_gather_partition_size": _INT,
    "enable_cuda_graph": _bool,
}

# "compile" has no "enabled": scripts call engine.compile(); the section tunes DeepCompile. Its defaults:
COMPILE_DEFAULTS = {
    "deepcompile": False, "autoep_non_moe": False, "free_activation": False, "free_activation_threshold": 10485760,
    "offload_activation": False, "offload_activation_pin_memory": True, "offload_opt_states": False,
    "double_buffer": True, "symmetric_memory": False, "debug_log": False, "offload_parameters": False,
    "sync_before_reduce": False, "sync_after_reduce": False, "sync_before_allgather": False,
    "sync_after_allgather": False, "keep_int_input_tensors": True, "keep_all_input_tensors": False, "passes": None,
}

_BATCH = _optional(_INT)
AUTOTUNING = {
    "fast": _bool,
    "results_dir": _STR,
    "exps_dir": _STR,
    "overwrite": _bool,
    "start_profile_step": _INT,
    "end_profile_step": _INT,
    "metric": _STR,
    "metric_path": _STR,
    "tuner_type": _STR,
    "tuner_early_stopping": _INT,
    "tuner_num_trials": _INT,
    "arg_mappings": _optional(_object),
    "model_info": _optional(_object),
    "model_info_path": _STR,
    "mp_size": _INT,
    "max_train_batch_size": _BATCH,
    "min_train_batch_size": _BATCH,
    "max_train_micro_batch_size_per_gpu": _BATCH,
    "min_train_micro_batch_size_per_gpu": _BATCH,
    "num_tuning_micro_batch_sizes": _INT,
}

_CURRICULUM_LEARNING = {
    "data_cluster_path": _STR,
    "curriculum_metrics": _optional(_object),
}
_DYNAMIC_BATCHING = {
    "metrics_path": _STR,
    "lr_scaling_method": _STR,
    "min_batch_size": _INT,
    "max_batch_size": _BATCH,
    "sequence_picking_order": _STR,
    "max_tokens": _BATCH,
    "verbose": _bool,
}
_RANDOM_LTD = {
    "model_mask_name": _STR,
    "model_type": _STR,
    "micro_batch_size": _INT,
    "global_batch_size": _INT,
    "sample_idx": _optional(_object),
    "attention_mask": _optional(_object),
    "hidden_state_order": _STR,
    "random_ltd_layer_num": _INT,
    "random_ltd_layer_id": _optional(_list_of(_INT)),
    "total_layer_num": _INT,
    "random_ltd_schedule": _optional(_object),
    "layer_token_lr_schedule": _optional(_object),
}

DATA_EFFICIENCY = {
    "seed": _INT,
    "data_sampling": _fields({
        **_ENABLED, "num_epochs": _INT, "num_workers": _INT, "pin_memory": _bool,
        "curriculum_learning": _fields({**_ENABLED, **_CURRICULUM_LEARNING}),
        "dynamic_batching": _fields({**_ENABLED, **_DYNAMIC_BATCHING}),
    }),
    "data_routing": _fields({**_ENABLED, "random_ltd": _fields({**_ENABLED, **_RANDOM_LTD})}),
}

OFFLOAD_OPTIMIZER = {
    "nvme_path": _STR,
    "buffer_count": _COUNT,
    "pin_memory": _bool,
    "pipeline_read": _bool,
    "pipeline_write": _bool,
    "fast_init": _bool,
    "ratio": _number(ge=0.0, le=1.0),
    "super_offload": _bool,
    "cpuadam_cores_perc": _number(ge=0.0, le=1.0),
}
OFFLOAD_PARAM = {
    "nvme_path": _STR,
    "buffer_count": _COUNT,
    "buffer_size": _integer(ge=0, whole_floats=True),
    "max_in_cpu": _integer(ge=0, whole_floats=True),
    "pin_memory": _bool,
}

REMOVED_SEE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"
# DeepSpeed's _REMOVED_TOP_LEVEL_CONFIG_KEYS / _REMOVED_ZERO_CONFIG_KEYS (runtime/config.py), abridged
REMOVED_TOP = {
    "nebula": "Nebula checkpointing has been removed.",
    "compression_training": "the DeepSpeed compression library has been removed.",
    "amp": "NVIDIA Apex AMP integration has been removed; use \"fp16\" or \"bf16\" instead.",
    "quantize_training": "Mixture-of-Quantization (MoQ, quantize_training) has been removed.",
    "sparse_gradients": "sparse compression of dense nn.Embedding gradients has been removed.",
    "eigenvalue": "eigenvalue-based Mixture-of-Quantization has been removed.",
    "sparse_attention": "DeepSpeed Sparse Attention has been removed.",
    "elasticity": "elastic training has been removed; set the batch sizes directly.",
    "graph_harvesting": "graph harvesting has been removed.",
    "curriculum_learning": ("the legacy top-level curriculum_learning has been removed (DeepSpeed has "
                            "data_efficiency.data_sampling.curriculum_learning instead)."),
    "progressive_layer_drop": "Progressive Layer Dropping has been removed.",
}
REMOVED_ZERO = {
    "mics_shard_size": "MiCS ZeRO-3 sharding has been removed.",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding has been removed.",
    "zeropp_loco_param": "LoCo-ZeRO++ has been removed.",
}
