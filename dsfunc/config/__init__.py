"""The DeepSpeed JSON config, parsed into frozen dataclasses.

``Config.load(source, world_size=...)`` reads a DeepSpeed config (dict, JSON file, base64 JSON, argparse
namespace with ``deepspeed_config``, or a ``Config``) with DeepSpeed 0.19's keys and defaults, resolves the
batch-size triple against the data-parallel world size, and validates every key and value. Each section is
described by a table (a ``_Schema``, :mod:`dsfunc.config.schema`): the keys dsfunc implements with their
default and check, the known DeepSpeed keys it accepts only in their default or disabled form, and alternative
spellings. Every problem raises ``ConfigError`` naming the key path.

One module per concept: ``schema`` (the table language), ``checks`` (value checks and rules), ``errors``
(``ConfigError`` and its wording), one module per section (``optimizer``, ``scheduler``, ``precision``,
``zero``, ``monitor``, ``flops_profiler``, ``unsupported``), ``batch`` (the batch triple), ``sources`` (dict, file, base64,
argparse), ``config`` (``Config`` itself) and ``announce`` (the start-up line about keys without effect).
Each field's docstring says what the key means in dsfunc and where it differs from DeepSpeed.

Where dsfunc deliberately differs from DeepSpeed:

* Unknown or misspelled keys are errors that suggest the closest valid key (DeepSpeed ignores unknown
  top-level keys and keys in its older sections, and only fails on optimizer/scheduler params when the class
  is constructed).
* Known DeepSpeed features that dsfunc does not have (offload to NVMe, ZeRO++, MiCS, Apex AMP,
  autotuning, ...) are accepted only while disabled or at their default value; asking for them
  is an error saying dsfunc does not support them, never a silent no-op.
* ``"auto"`` values are errors: they are placeholders the Hugging Face Trainer fills in (DeepSpeed drops them
  inside its pydantic sections, i.e. silently uses the default).
* The batch triple follows DeepSpeed's inference, but a train batch that does not divide evenly is reported as
  such (DeepSpeed floor-divides and then fails with a mismatch assertion); every batch error prints all three
  values, the world size, the rule and values that would work.
* Optimizer types are matched case-insensitively; Adam, AdamW, SGD, Lamb, Adagrad and Muon are supported. As in
  DeepSpeed, ``"Adam"`` runs decoupled AdamW math unless ``adam_w_mode`` is false; ``"AdamW"`` with
  ``adam_w_mode: false`` is an error (DeepSpeed silently keeps AdamW). Params are validated and completed with
  DeepSpeed's defaults.
* Scheduler types are matched case-insensitively. An unknown ``warmup_type`` is an error (DeepSpeed warns and
  uses "log"); ``total_num_steps < warmup_num_steps`` is an error (DeepSpeed warns); learning rates must be
  scalars (DeepSpeed also takes per-param-group lists). OneCycle's ``cycle_second_*`` values default to the
  ``cycle_first_*`` ones at parse time.
* Loss-scaling keys copied into ``bf16`` are errors (bf16 needs no loss scale; DeepSpeed's pydantic model also
  rejects them).
* Files are read as HJSON, as DeepSpeed reads them (comments, trailing commas); the error gives line and
  column.
* ``fp16.raise_error_at_min_scale`` is a dsfunc key: false keeps skipping steps at the minimum loss scale
  instead of stopping the run.
* ``zero_allow_untested_optimizer`` is parsed and recorded; dsfunc.config does not apply DeepSpeed's
  untested-optimizer check.
* Nine ``zero_optimization`` keys tune machinery dsfunc's ZeRO does not have (each unit is gathered and
  reduced whole, as one flat buffer): ``allgather_bucket_size``, ``contiguous_gradients``, ``reduce_scatter``,
  ``allgather_partitions``, ``stage3_max_reuse_distance``, ``ignore_unused_parameters``, ``sub_group_size``,
  ``round_robin_gradients``, ``stage3_module_granularity_threshold``; so do ``bf16.immediate_grad_update``
  and ``check_grad_overflow`` (dsfunc has one behaviour for each) and ``pipeline.use_reentrant``, and offload
  sections below the stage that uses them (DeepSpeed ignores them too). Any valid value is accepted (tutorial
  configs set them at their defaults; a wrong type is an error), and ``Config.without_effect()`` names those a
  config sets, with why; ``init_state`` logs those lines once per process on rank 0
  (``announce_without_effect``, "dsfunc" logger).
* DeepSpeed's deprecated ``cpu_offload`` / ``cpu_offload_param`` read as the offload sections they stand for.
"""

from dsfunc.config.activation_checkpointing import (
    ActivationCheckpointingConfig,
    parse_activation_checkpointing,
)
from dsfunc.config.announce import announce_without_effect
from dsfunc.config.compile import CompileConfig, parse_compile
from dsfunc.config.config import Config, mesh_sections
from dsfunc.config.errors import ConfigError
from dsfunc.config.flops_profiler import FlopsProfilerConfig
from dsfunc.config.monitor import CometConfig, MonitorConfig, WandbConfig
from dsfunc.config.optimizer import OptimizerConfig, parse_optimizer
from dsfunc.config.parallel import TensorParallelConfig, parse_tensor_parallel
from dsfunc.config.pipeline import PipelineConfig, parse_pipeline
from dsfunc.config.precision import BF16Config, FP16Config
from dsfunc.config.scheduler import SchedulerConfig, parse_scheduler
from dsfunc.config.zero import ZeroConfig
from dsfunc.frozen import FrozenDict

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CometConfig",
    "CompileConfig",
    "Config",
    "ConfigError",
    "FP16Config",
    "FlopsProfilerConfig",
    "FrozenDict",
    "MonitorConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "WandbConfig",
    "ZeroConfig",
    "announce_without_effect",
    "mesh_sections",
    "parse_activation_checkpointing",
    "parse_compile",
    "parse_optimizer",
    "parse_pipeline",
    "parse_scheduler",
    "parse_tensor_parallel",
]
