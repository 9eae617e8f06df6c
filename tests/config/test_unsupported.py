"""Known DeepSpeed sections dsfunc does not implement: accepted while off, errors when on."""

from __future__ import annotations

import pytest

from tests.config.helpers import error, load


@pytest.mark.parametrize(
    "section",
    [
        {"amp": {"enabled": False, "opt_level": "O1"}},
        {
            "flops_profiler": {
                "enabled": False,
                "profile_step": 1,
                "module_depth": -1,
                "top_modules": 1,
                "detailed": True,
            }
        },
        {
            "activation_checkpointing": {
                "partition_activations": False,
                "cpu_checkpointing": False,
                "contiguous_memory_optimization": False,
                "number_checkpoints": None,
                "synchronize_checkpoint_boundary": False,
                "profile": False,
            }
        },
        {"autotuning": {"enabled": False, "fast": True}},
        {"elasticity": {"enabled": False, "max_train_batch_size": 100}},
        {"pipeline": {"stages": "auto", "partition": "best", "pipe_partitioned": True}},
        {"sparse_attention": {}},
        {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}}},
        {"wandb": {"enabled": False, "project": "x", "team": None}},
        {"comet": {"enabled": False}},
        {"comms_logger": {"enabled": False, "verbose": True}},
        {"aio": {"block_size": 1048576, "queue_depth": 16}},
        {
            "checkpoint": {
                "tag_validation": "warn",
                "load_universal": False,
                "parallel_write": {"pipeline_stage": False},
            }
        },
        {"data_efficiency": {"enabled": False, "data_sampling": {"enabled": False}}},
        {"timers": {"throughput": {"enabled": True, "synchronized": True}}},
        {"memory_breakdown": False},
        {"dump_state": False},
        {"log_level": None},
        {"vocabulary_size": 50257},
        {"sparse_gradients": False},
        {"zero_force_ds_cpu_optimizer": False},
        {"disable_allgather": False},
        {"gradient_allreduce_op": "mean"},
        {"torch_autocast": {"enabled": False, "dtype": "bfloat16"}},
        {"hybrid_engine": {"enabled": False}},
        {"compile": {"enabled": False}},
        {"tensor_parallel": {}},
        {"sequence_parallel_size": 1},
        {"managed_gradient_accumulation": True},
    ],
)
def test_unimplemented_sections_accepted_when_off(section):
    assert load(section).raw == {"train_batch_size": 8, **section}


@pytest.mark.parametrize(
    "section, expected",
    [
        (
            {"amp": {"enabled": True}},
            (
                "amp.enabled = true: dsfunc does not support Apex AMP yet. Set it to false or remove "
                '"amp". Use "fp16" or "bf16" instead.'
            ),
        ),
        (
            {"flops_profiler": {"enabled": True}},
            "flops_profiler.enabled = true: dsfunc does not support the FLOPs profiler",
        ),
        (
            {"activation_checkpointing": {"partition_activations": True}},
            (
                "activation_checkpointing.partition_activations = true: dsfunc does not support partitioned "
                "activations (they split over model-parallel ranks; dsfunc has none) yet."
            ),
        ),
        ({"autotuning": {"enabled": True}}, "dsfunc does not support autotuning yet"),
        ({"elasticity": {"enabled": True}}, "dsfunc does not support elastic batch sizes yet"),
        (
            {"pipeline": {"stages": 2}},
            (
                "pipeline.stages = 2: dsfunc does not support pipeline parallelism yet. Remove the "
                'key or set it to "auto"'
            ),
        ),
        ({"sparse_attention": {"mode": "fixed"}}, "dsfunc does not support sparse attention yet"),
        (
            {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
            (
                "compression_training.weight_quantization.shared_parameters.enabled = true: "
                "dsfunc does not support compression training yet"
            ),
        ),
        (
            {"wandb": {"enabled": True, "project": "x"}},
            (
                "wandb.enabled = true: dsfunc does not support the Weights & Biases monitor yet. "
                'Set it to false or remove "wandb". dsfunc has "tensorboard" and "csv_monitor".'
            ),
        ),
        ({"wandb": {"enabled": "yes"}}, 'wandb.enabled = "yes" is invalid: expected true or false.'),
        ({"wandb": True}, "wandb = true is invalid: expected a JSON object."),
        ({"comet": {"enabled": True}}, "the Comet monitor"),
        ({"comms_logger": {"enabled": True}}, "the communication logger"),
        (
            {"checkpoint": {"load_universal": True}},
            "checkpoint.load_universal = true: dsfunc does not support these checkpoint options yet",
        ),
        ({"checkpoint": {"tag_validation": "Fail"}}, 'checkpoint.tag_validation = "Fail"'),
        (
            {"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
            "checkpoint.parallel_write.pipeline_stage = true",
        ),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency.enabled = true"),
        (
            {"timers": {"throughput": {"enabled": False}}},
            "timers.throughput.enabled = false: dsfunc does not support",
        ),
        (
            {"memory_breakdown": True},
            "memory_breakdown = true: dsfunc does not support memory breakdown logging yet",
        ),
        ({"dump_state": True}, "dump_state = true"),
        ({"log_level": "info"}, 'log_level = "info": dsfunc does not support log_level yet'),
        ({"sparse_gradients": True}, "sparse embedding gradients"),
        ({"disable_allgather": True}, "disable_allgather = true"),
        (
            {"gradient_allreduce_op": "sum"},
            'gradient_allreduce_op = "sum": dsfunc does not support summed gradient',
        ),
        ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled = true"),
        ({"hybrid_engine": {"enabled": True}}, "the hybrid (RLHF) engine"),
        ({"tensor_parallel": {"autotp_size": 2}}, "dsfunc does not support tensor parallelism yet"),
        (
            {"sequence_parallel_size": 2},
            "sequence_parallel_size = 2: dsfunc does not support sequence parallelism",
        ),
        ({"managed_gradient_accumulation": False}, "unmanaged gradient accumulation"),
        ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads = true"),
        ({"bf16": {"immediate_grad_update": True}}, "bf16.immediate_grad_update = true"),
        ({"bf16": {"check_grad_overflow": False}}, "bf16.check_grad_overflow = false"),
        ({"data_types": {"param_dtype": "bf16"}}, 'data_types.param_dtype = "bf16": dsfunc does not support'),
        ({"optimizer": {"type": "Adam", "legacy_fusion": True}}, "optimizer.legacy_fusion = true"),
    ],
)
def test_unimplemented_sections_rejected_when_on(section, expected):
    assert expected in error({"train_batch_size": 8, **section})


def test_unknown_key_inside_default_only_section():
    msg = error({"train_batch_size": 8, "activation_checkpointing": {"partition_activation": False}})
    assert msg.startswith(
        'Unknown config key "activation_checkpointing.partition_activation". Did you mean '
        '"activation_checkpointing.partition_activations"?'
    )
