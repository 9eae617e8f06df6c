"""dsfunc: DeepSpeed re-thought as a functional, JAX-style trainer for PyTorch.

    state = dsfunc.init_state(model, "ds_config.json", loss_fn=loss_fn)
    for batch in loader:
        state = dsfunc.train_step(state, batch)

The functional core comes first below; the DeepSpeed surface (``initialize``, the engine, the
launcher's ``init_distributed``) is re-exported so that ``import dsfunc as deepspeed`` works, and
DeepSpeed's modules answer under dsfunc (``deepspeed.accelerator`` is ``dsfunc.accelerator``, a script's
``from deepspeed.comm import get_rank`` becomes ``from dsfunc.comm import get_rank``; see
:mod:`dsfunc.deepspeed.namespace`).
"""

import importlib as _importlib

from dsfunc.config import (
    BF16Config,
    Config,
    ConfigError,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from dsfunc.deepspeed import (
    DeepSpeedConfig,
    DeepSpeedConfigError,
    DeepSpeedEngine,
    DeepSpeedHybridEngine,
    DeepSpeedOptimizer,
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
    Engine,
    InferenceEngine,
    OnDevice,
    PipelineEngine,
    PipelineModule,
    add_config_arguments,
    add_tuning_arguments,
    get_accelerator,
    init_inference,
    initialize,
    log_dist,
    logger,
    tp_model_init,
)
from dsfunc.deepspeed import namespace as _namespace
from dsfunc.distributed import get_local_rank, get_rank, get_world_size, init_distributed
from dsfunc.errors import Error, InputError, InputTypeError, NotSupportedError, UsageError
from dsfunc.grad import (
    GradContext,
    GradResult,
    accumulate,
    default_grad_fn,
    scale_loss,
    shard,
    value_and_grad,
)
from dsfunc.init import full_params, init_state
from dsfunc.optim import (
    ParamGroups,
    Transform,
    adagrad,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    current_lr,
    lamb,
    multi_transform,
    named_chain,
    scale_by_adam,
    scale_by_factor,
    scale_by_learning_rate,
    scale_by_schedule,
    schedule_from_config,
    sgd,
)
from dsfunc.scaling import LossScaleError, LossScaler, LossScaleState
from dsfunc.schedules import lr_range_test, one_cycle, warmup_cosine_lr, warmup_decay_lr, warmup_lr
from dsfunc.state import DonatedStateError, FrozenDict, Metrics, TrainState
from dsfunc.step import apply_gradients, make_train_step, train_step
from dsfunc.tiling import tiled, tiled_loss, tiled_mlp
from dsfunc.version import git_info as _git_info
from dsfunc.version import package_version as _package_version
from dsfunc.version import version_parts as _version_parts

__version__ = _package_version()
__version_major__, __version_minor__, __version_patch__ = _version_parts(__version__)

_namespace.install()


# dsfunc.checkpoint's names, imported on first use: DCP and DTensor take about a second to import
_CHECKPOINT_NAMES = frozenset({
    "CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError", "CheckpointNotFoundError",
    "CheckpointTagError", "CheckpointTimeoutError", "CheckpointUnsupportedError", "export_fp32", "export_hf", "load_checkpoint",
    "save_checkpoint", "wait_for_checkpoint",
})


def __getattr__(name: str) -> object:
    """dsfunc.checkpoint and its names, and DeepSpeed's top-level packages (``deepspeed.accelerator``,
    ``deepspeed.comm``, ``deepspeed.ops``, ``deepspeed.utils``, ``deepspeed.runtime``, ``deepspeed.pipe``, ...),
    imported on first use."""
    if name in ("__git_hash__", "__git_branch__"):  # DeepSpeed's; asked of git on first use
        return _git_info()[name != "__git_hash__"]
    if name == "checkpoint" or name in _CHECKPOINT_NAMES:
        checkpoint = _importlib.import_module("dsfunc.checkpoint")
        return checkpoint if name == "checkpoint" else getattr(checkpoint, name)
    return _namespace.package(name)

__all__ = [  # noqa: RUF022 - grouped by layer, as the imports above
    # functional core
    "DonatedStateError",
    "Error",
    "FrozenDict",
    "GradContext",
    "GradResult",
    "InputError",
    "InputTypeError",
    "LossScaleError",
    "LossScaleState",
    "LossScaler",
    "Metrics",
    "NotSupportedError",
    "ParamGroups",
    "TrainState",
    "Transform",
    "UsageError",
    "accumulate",
    "adagrad",
    "adam",
    "adamw",
    "apply_gradients",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "current_lr",
    "default_grad_fn",
    "full_params",
    "init_state",
    "lamb",
    "lr_range_test",
    "make_train_step",
    "multi_transform",
    "named_chain",
    "one_cycle",
    "scale_by_adam",
    "scale_by_factor",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_loss",
    "schedule_from_config",
    "sgd",
    "shard",
    "tiled",
    "tiled_loss",
    "tiled_mlp",
    "train_step",
    "value_and_grad",
    "warmup_cosine_lr",
    "warmup_decay_lr",
    "warmup_lr",
    # configs, checkpoints, processes
    "BF16Config",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTagError",
    "CheckpointTimeoutError",
    "CheckpointUnsupportedError",
    "Config",
    "ConfigError",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "export_fp32",
    "export_hf",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "load_checkpoint",
    "save_checkpoint",
    "wait_for_checkpoint",
    # the DeepSpeed surface (and deepspeed.accelerator, .comm, .ops, .utils, .zero, ... as modules)
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "DeepSpeedHybridEngine",
    "DeepSpeedOptimizer",
    "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer",
    "Engine",
    "InferenceEngine",
    "OnDevice",
    "PipelineEngine",
    "PipelineModule",
    "add_config_arguments",
    "add_tuning_arguments",
    "get_accelerator",
    "init_inference",
    "initialize",
    "log_dist",
    "logger",
    "tp_model_init",
]
