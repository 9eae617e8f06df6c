"""Top-level DeepSpeed sections dsfunc does not implement, accepted only while off or at their default."""

from __future__ import annotations

from dsfunc.config.checks import _empty, _inert, _off, _only
from dsfunc.config.schema import Rule

_UNSUPPORTED_TOP: dict[str, Rule] = {
    "amp": _off("Apex AMP", 'Use "fp16" or "bf16" instead.'),
    "flops_profiler": _off("the FLOPs profiler"),
    "autotuning": _off("autotuning"),
    "elasticity": _off("elastic batch sizes"),
    "pipeline": _only(
        {
            "stages": "auto",
            "partition": "best",
            "seed_layers": False,
            "activation_checkpoint_interval": 0,
            "pipe_partitioned": True,
            "grad_partitioned": True,
        },
        feature="pipeline parallelism",
    ),
    "sparse_attention": _empty("sparse attention"),
    "compression_training": _off("compression training"),
    "data_efficiency": _off("data efficiency (curriculum learning, random-LTD)"),
    "curriculum_learning": _off("curriculum learning"),
    "wandb": _off("the Weights & Biases monitor", 'dsfunc has "tensorboard" and "csv_monitor".'),
    "comet": _off("the Comet monitor", 'dsfunc has "tensorboard" and "csv_monitor".'),
    "comms_logger": _off("the communication logger"),
    "aio": _inert,  # tunes NVMe I/O, which only offload (rejected) uses
    "checkpoint": _only(
        {
            "tag_validation": "Warn",
            "load_universal": False,
            "use_node_local_storage": False,
            "parallel_write": {"pipeline_stage": False},
        },
        feature="these checkpoint options",
        fix="dsfunc checkpoints load at any world size without conversion.",
    ),
    "timers": _only(
        {"throughput": {"enabled": True, "synchronized": True}}, feature="configuring the timers"
    ),
    "memory_breakdown": _only(False, feature="memory breakdown logging"),
    "dump_state": _only(False, feature="dumping the engine state"),
    "log_level": _only(
        None,
        feature="log_level",
        fix='dsfunc logs to the "dsfunc" logger; set its level with the logging module.',
    ),
    "vocabulary_size": _inert,  # DeepSpeed only warns when it is not a multiple of 8
    "sparse_gradients": _only(False, feature="sparse embedding gradients"),
    "zero_force_ds_cpu_optimizer": _inert,  # only concerns CPU offload, which is rejected
    "disable_allgather": _only(False, feature="disable_allgather"),
    "gradient_allreduce_op": _only("mean", feature="summed gradient reduction"),
    "torch_autocast": _off("torch.autocast mixed precision", 'Use "fp16" or "bf16".'),
    "progressive_layer_drop": _off("progressive layer drop"),
    "eigenvalue": _off("eigenvalue computation"),
    "hybrid_engine": _off("the hybrid (RLHF) engine"),
    "nebula": _off("Nebula checkpointing"),
    "quantize_training": _off("quantized training"),
    "weight_quantization": _empty("weight quantization"),
    "tensor_parallel": _empty("tensor parallelism"),
    "expert_parallel": _empty("expert parallelism"),
    "sequence_parallel_size": _only(1, feature="sequence parallelism"),
    "seq_parallel_communication_data_type": _inert,  # only used by sequence parallelism
    "managed_gradient_accumulation": _only(True, feature="unmanaged gradient accumulation"),
}
