"""dsfunc: DeepSpeed re-thought as a functional, JAX-style trainer for PyTorch.

    state = dsfunc.init_state(model, "ds_config.json", loss_fn=loss_fn)
    for batch in loader:
        state = dsfunc.train_step(state, batch)
"""

from dsfunc.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    export_fp32,
    load_checkpoint,
    save_checkpoint,
    wait_for_checkpoint,
)
from dsfunc.config import (
    BF16Config,
    Config,
    ConfigError,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from dsfunc.dist import get_local_rank, get_rank, get_world_size, init_distributed
from dsfunc.engine import Engine, add_config_arguments, initialize
from dsfunc.optim import (
    Transform,
    adagrad,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    current_lr,
    lamb,
    named_chain,
    scale_by_adam,
    scale_by_factor,
    scale_by_learning_rate,
    scale_by_schedule,
    sgd,
)
from dsfunc.program import full_params, init_state
from dsfunc.scaling import LossScaleError, LossScaler, LossScaleState
from dsfunc.schedules import (
    lr_range_test,
    one_cycle,
    schedule_from_config,
    warmup_cosine_lr,
    warmup_decay_lr,
    warmup_lr,
)
from dsfunc.state import DonatedStateError, FrozenDict, Metrics, TrainState
from dsfunc.step import (
    GradContext,
    GradResult,
    accumulate,
    apply_gradients,
    default_grad_fn,
    make_train_step,
    scale_loss,
    shard,
    train_step,
    value_and_grad,
)

__version__ = "0.1.0"

__all__ = [
    "BF16Config",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "Config",
    "ConfigError",
    "DonatedStateError",
    "Engine",
    "FP16Config",
    "FrozenDict",
    "GradContext",
    "GradResult",
    "LossScaleError",
    "LossScaleState",
    "LossScaler",
    "Metrics",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainState",
    "Transform",
    "ZeroConfig",
    "accumulate",
    "adagrad",
    "adam",
    "adamw",
    "add_config_arguments",
    "apply_gradients",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "current_lr",
    "default_grad_fn",
    "export_fp32",
    "full_params",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "init_state",
    "initialize",
    "lamb",
    "load_checkpoint",
    "lr_range_test",
    "make_train_step",
    "named_chain",
    "one_cycle",
    "save_checkpoint",
    "scale_by_adam",
    "scale_by_factor",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_loss",
    "schedule_from_config",
    "sgd",
    "shard",
    "train_step",
    "value_and_grad",
    "wait_for_checkpoint",
    "warmup_cosine_lr",
    "warmup_decay_lr",
    "warmup_lr",
]
