"""Update transforms: optimizers, clipping and learning rates as pure ``(init, update)`` pairs (the optax
pattern), and the updates a step applies (:mod:`~dsfunc.optim.update`, :mod:`~dsfunc.optim.fused`).

Modules: :mod:`~dsfunc.optim.base` (``Transform``, ``chain``, ``named_chain``, ``multi_transform``),
``transforms`` (the small factories, each beside its state), ``aliases`` (``adam``, ``adamw``, ``sgd``, ``lamb``, ``adagrad``),
``groups`` (``ParamGroups``: options per group of parameters), ``from_config`` (the one place a
DeepSpeed config becomes an update), ``update`` and ``fused`` (applying an update to a state), ``torch_optimizer``
(a client's ``torch.optim.Optimizer`` as the update).
"""

from dsfunc.optim.aliases import adagrad, adam, adamw, lamb, sgd
from dsfunc.optim.base import (
    EmptyState,
    Transform,
    apply_updates,
    chain,
    identity,
    multi_transform,
    named_chain,
    stateless,
)
from dsfunc.optim.from_config import (
    lr_schedule,
    momentum_schedule_from_config,
    optimizer_from_config,
    schedule_from_config,
    update_from_config,
)
from dsfunc.optim.fused import FusedAdam
from dsfunc.optim.groups import ParamGroups
from dsfunc.optim.transforms import (
    ScaleByAdamState,
    ScaleByRssState,
    ScaleByScheduleState,
    ScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    current_lr,
    global_norm,
    scale_by_adam,
    scale_by_factor,
    scale_by_learning_rate,
    scale_by_rss,
    scale_by_schedule,
    scale_by_trust_ratio,
    trace,
)
from dsfunc.optim.update import ChainUpdate, UpdateContext

__all__ = [
    "ChainUpdate",
    "EmptyState",
    "FusedAdam",
    "ParamGroups",
    "ScaleByAdamState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "ScheduleState",
    "TraceState",
    "Transform",
    "UpdateContext",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "current_lr",
    "global_norm",
    "identity",
    "lamb",
    "lr_schedule",
    "momentum_schedule_from_config",
    "multi_transform",
    "named_chain",
    "optimizer_from_config",
    "scale_by_adam",
    "scale_by_factor",
    "scale_by_learning_rate",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_trust_ratio",
    "schedule_from_config",
    "sgd",
    "stateless",
    "trace",
    "update_from_config",
]
