"""dsfunc: DeepSpeed re-thought as a functional, JAX-style trainer for PyTorch.

    state = dsfunc.init_state(model, "ds_config.json", loss_fn=loss_fn)
    for batch in loader:
        state = dsfunc.train_step(state, batch)
"""

from dsfunc.config import Config, ConfigError
from dsfunc.optim import (
    Transform,
    adagrad,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    lamb,
    named_chain,
    scale_by_learning_rate,
    scale_by_schedule,
    sgd,
)
from dsfunc.program import full_params, init_state
from dsfunc.scaling import LossScaleError
from dsfunc.state import DonatedStateError, FrozenDict, Metrics, TrainState
from dsfunc.step import (
    GradContext,
    GradResult,
    accumulate,
    default_grad_fn,
    make_train_step,
    scale_loss,
    shard,
    train_step,
    value_and_grad,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DonatedStateError",
    "FrozenDict",
    "GradContext",
    "GradResult",
    "LossScaleError",
    "Metrics",
    "TrainState",
    "Transform",
    "accumulate",
    "adagrad",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "default_grad_fn",
    "full_params",
    "init_state",
    "lamb",
    "make_train_step",
    "named_chain",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_loss",
    "sgd",
    "shard",
    "train_step",
    "value_and_grad",
]
