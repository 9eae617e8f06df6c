"""The named optimizers, each a :func:`~dsfunc.optim.base.named_chain` of the small factories, with
DeepSpeed's parameter names: their state reads like ``state["adam"].mu`` and ``state["lr"].lr``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dsfunc.optim.base import ScalarOrSchedule, Transform, _check, _check_betas, named_chain
from dsfunc.optim.transforms import (
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_rss,
    scale_by_schedule,
    scale_by_trust_ratio,
    trace,
)
from dsfunc.schedules import Schedule


def adam(lr: ScalarOrSchedule = 1e-3, betas: Sequence[ScalarOrSchedule] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, bias_correction: bool = True, adam_w_mode: bool = True) -> Transform:
    """DeepSpeed's Adam: decoupled weight decay when ``adam_w_mode`` (DeepSpeed's default, = torch AdamW), else L2
    added to the gradient (torch.optim.Adam). State keys: ``weight_decay``, ``adam``, ``lr``."""
    b1, b2 = _check_betas(betas, "adam")
    decay = ("weight_decay", add_decayed_weights(weight_decay))
    direction = ("adam", scale_by_adam(b1, b2, eps, bias_correction))
    steps = [direction, decay] if adam_w_mode else [decay, direction]
    return named_chain(*steps, ("lr", scale_by_learning_rate(lr)))


def adamw(lr: ScalarOrSchedule = 1e-3, betas: Sequence[ScalarOrSchedule] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.0, bias_correction: bool = True) -> Transform:
    """Adam with decoupled weight decay (``adam(..., adam_w_mode=True)``)."""
    return adam(lr, betas, eps, weight_decay, bias_correction, adam_w_mode=True)


def lamb(lr: ScalarOrSchedule = 1e-3, betas: Sequence[ScalarOrSchedule] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, bias_correction: bool = True, max_coeff: float = 10.0,
         min_coeff: float = 0.01) -> Transform:
    """LAMB (You et al. 2019): ``r = adam direction + weight_decay * p``, ``p -= lr * ratio * r`` with the trust
    ratio ``||p|| / ||r||`` clamped to ``[min_coeff, max_coeff]`` as DeepSpeed's FusedLamb does (1 when either norm
    is 0). State keys: ``adam``, ``weight_decay``, ``trust_ratio``, ``lr``."""
    b1, b2 = _check_betas(betas, "lamb")
    return named_chain(("adam", scale_by_adam(b1, b2, eps, bias_correction)),
                       ("weight_decay", add_decayed_weights(weight_decay)),
                       ("trust_ratio", scale_by_trust_ratio(min_coeff, max_coeff)),
                       ("lr", scale_by_learning_rate(lr)))


def sgd(lr: ScalarOrSchedule = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False) -> Transform:
    """torch.optim.SGD: L2 weight decay, then momentum (:func:`trace`, omitted when ``momentum == 0``), then lr.
    State keys: ``weight_decay``, ``momentum`` (when used), ``lr``."""
    steps = [("weight_decay", add_decayed_weights(weight_decay))]
    if momentum != 0 or nesterov:
        steps.append(("momentum", trace(momentum, dampening, nesterov)))
    return named_chain(*steps, ("lr", scale_by_learning_rate(lr)))


def _inverse_time_decay(lr_decay: float) -> Schedule:
    def schedule(t: Tensor) -> Tensor:
        return (1.0 / (1.0 + (t + 1).to(torch.float64) * lr_decay)).to(torch.float32)

    return schedule


def adagrad(lr: ScalarOrSchedule = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
            initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> Transform:
    """torch.optim.Adagrad: L2 weight decay, ``g / (sqrt(sum g^2) + eps)``, times ``lr / (1 + k * lr_decay)`` at
    the k-th step (k = 0, 1, ...). State keys: ``weight_decay``, ``rss``, ``lr_decay`` (when used), ``lr``."""
    _check(lr_decay >= 0, f"lr_decay must be >= 0, got {lr_decay!r}")
    steps = [("weight_decay", add_decayed_weights(weight_decay)),
             ("rss", scale_by_rss(initial_accumulator_value, eps))]
    if lr_decay != 0:
        steps.append(("lr_decay", scale_by_schedule(_inverse_time_decay(lr_decay))))
    return named_chain(*steps, ("lr", scale_by_learning_rate(lr)))


