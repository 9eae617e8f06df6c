"""Translating a client ``torch.optim`` optimizer and lr scheduler into dsfunc's update and schedule.

``deepspeed.initialize(optimizer=..., lr_scheduler=...)`` takes torch objects; dsfunc trains with its
own update, so a fresh torch Adam/AdamW/SGD/Adagrad becomes the equivalent DeepSpeed ``optimizer``
section (its ``param_groups`` parameter groups with their own options), and a fresh StepLR/MultiStepLR/
ExponentialLR/LinearLR/ConstantLR/CosineAnnealingLR/LambdaLR the equivalent schedule of each group
(torch's schedulers scale each group's own lr). Any other torch optimizer (or one with an option dsfunc's
update lacks, such as ``amsgrad``) runs its own ``step()`` on the state's shards
(:mod:`dsfunc.optim.torch_optimizer`); another scheduler on the client's optimizer is stepped by the engine,
which follows the lr it writes (ReduceLROnPlateau, which needs a metric, is refused), as it does with DeepSpeed's own
scheduler classes built on the client optimizer (:mod:`dsfunc.deepspeed.lr_schedules`).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from dsfunc.deepspeed.lr_schedules import hand_built
from dsfunc.deepspeed.ops import DeepSpeedOptimizer
from dsfunc.errors import InputError, InputTypeError
from dsfunc.optim.from_config import LrSchedule
from dsfunc.optim.groups import GROUP_METADATA, plain
from dsfunc.schedules import Schedule

logger = logging.getLogger("dsfunc")

_TORCH_OPTIMIZERS: dict[type, tuple[str, tuple[str, ...]]] = {
    torch.optim.Adam: ("Adam", ("lr", "betas", "eps", "weight_decay")),
    torch.optim.AdamW: ("AdamW", ("lr", "betas", "eps", "weight_decay")),
    torch.optim.SGD: ("SGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
    torch.optim.Adagrad: ("Adagrad", ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")),
}
_ZERO_TESTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)  # DeepSpeed's list, less its own classes
_IMPLEMENTATION_ONLY = ("foreach", "fused", "capturable", "differentiable")  # pick a kernel, not the math


def _public_name(cls: type) -> str:
    """``torch.optim.RMSprop`` rather than ``torch.optim.rmsprop.RMSprop``."""
    module = cls.__module__
    if module.startswith("torch.optim.") and module != "torch.optim.lr_scheduler":
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


class ClientObjectError(InputError, AssertionError):
    """A client optimizer or lr scheduler that DeepSpeed refuses with an assertion (caught as ``AssertionError``)."""


def translatable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`optimizer_section` maps ``optimizer`` onto a config section (else its own ``step()`` runs:
    :mod:`dsfunc.optim.torch_optimizer`)."""
    if isinstance(optimizer, DeepSpeedOptimizer):
        return True
    if type(optimizer) not in _TORCH_OPTIMIZERS:
        return False
    defaults = _defaults(type(optimizer))
    try:  # an option without a dsfunc equivalent (amsgrad, maximize, ...): the optimizer's own step runs
        for g in optimizer.param_groups:
            _hyper(type(optimizer), {k: plain(v) for k, v in g.items() if k != "params"}, defaults)
    except InputError:
        return False
    return True


def zero_tested(optimizer: torch.optim.Optimizer) -> bool:
    """Whether DeepSpeed runs ``optimizer`` under ZeRO without ``zero_allow_untested_optimizer``."""
    return isinstance(optimizer, DeepSpeedOptimizer) or type(optimizer) in _ZERO_TESTED


def _defaults(kind: type) -> dict[str, Any]:
    return {n: plain(p.default) for n, p in inspect.signature(kind.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def check_fresh(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a client optimizer that holds state: dsfunc starts the optimizer from scratch."""
    if _has_stepped(optimizer):
        raise InputError(
            f"the client {_public_name(type(optimizer))} has state (it has taken steps or loaded a state_dict); "
            "dsfunc starts the optimizer from scratch. Pass a fresh optimizer and resume with engine.load_checkpoint"
        )


def drop_empty_groups(optimizer: torch.optim.Optimizer) -> None:
    """Remove the parameter groups without parameters from ``optimizer``, in place, as DeepSpeed does."""
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if len(g["params"]) > 0]


def optimizer_section(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[tuple[list[torch.Tensor], dict[str, Any]]]]:
    """The DeepSpeed ``optimizer`` config section equivalent to a fresh torch optimizer, and its
    ``param_groups`` as ``(params, options)`` pairs, each group's options its own hyper-parameters.

    Maps ``torch.optim.Adam`` (L2, or decoupled with ``decoupled_weight_decay``), ``AdamW``, ``SGD`` and
    ``Adagrad``, and DeepSpeed's optimizer classes (:mod:`dsfunc.deepspeed.ops`); options that only choose an implementation (``foreach``, ``fused``, ...) are ignored;
    any other option away from torch's default (``amsgrad``, ``maximize``, ...) is refused.
    """
    if isinstance(optimizer, DeepSpeedOptimizer):
        section = {"type": optimizer.config_type, "params": optimizer.config_params(optimizer.defaults)}
        return section, [(list(g["params"]), optimizer.config_params(g)) for g in optimizer.param_groups]
    kind = type(optimizer)
    if kind not in _TORCH_OPTIMIZERS:
        raise InputTypeError(
            f"optimizer: a {_public_name(kind)} cannot be translated to a dsfunc update; "
            "pass a torch.optim.Adam, AdamW, SGD or Adagrad (or a callable returning one), or leave "
            'optimizer out and describe it in the config\'s "optimizer" section (Adam, AdamW, SGD, Lamb, Adagrad)'
        )
    check_fresh(optimizer)
    name, _ = _TORCH_OPTIMIZERS[kind]
    defaults = _defaults(kind)
    section = {"type": name, "params": _hyper(kind, {k: plain(v) for k, v in optimizer.defaults.items()}, defaults)}
    groups = [(list(g["params"]), _hyper(kind, {k: plain(v) for k, v in g.items() if k != "params"}, defaults))
              for g in optimizer.param_groups]
    return section, groups


def _hyper(kind: type, group: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A torch param group's (or the defaults') options as DeepSpeed ``optimizer.params``."""
    name, hyper = _TORCH_OPTIMIZERS[kind]
    params: dict[str, Any] = {"lr": group.get("initial_lr", group["lr"])}
    if name == "Adam":
        params["adam_w_mode"] = bool(group.get("decoupled_weight_decay", False))
    for key, value in group.items():
        if key in hyper:
            params.setdefault(key, value)
        elif key in _IMPLEMENTATION_ONLY or key in ("initial_lr", "decoupled_weight_decay", *GROUP_METADATA):
            continue
        elif key not in defaults or value != defaults[key]:
            raise InputError(
                f"torch.optim.{name}({key}={value!r}) has no dsfunc equivalent; drop that option or describe "
                'the optimizer in the config\'s "optimizer" section'
            )
    return params


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """True when a torch optimizer has taken a step (Adagrad creates its state, at step 0, up front)."""
    return any("step" not in st or float(st["step"]) > 0 for st in optimizer.state.values())


def _closed_form(sched: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``k -> lr / base_lr`` (float64 tensors) for torch schedulers with a closed form."""
    sch = torch.optim.lr_scheduler
    kind = type(sched)
    if kind is sch.StepLR:
        return lambda k: sched.gamma ** torch.div(k, sched.step_size, rounding_mode="floor")
    if kind is sch.MultiStepLR:
        milestones = sorted(sched.milestones.elements())
        return lambda k: sched.gamma ** sum((k >= m).to(torch.float64) for m in milestones) \
            if milestones else torch.ones_like(k)
    if kind is sch.ExponentialLR:
        return lambda k: sched.gamma ** k
    if kind is sch.LinearLR:
        start, end, total = sched.start_factor, sched.end_factor, sched.total_iters
        return lambda k: start + (end - start) * k.clamp(max=total) / total
    if kind is sch.ConstantLR:
        return lambda k: torch.where(k >= sched.total_iters, 1.0, sched.factor).to(torch.float64)
    return None


def schedule_from_torch(sched: Any) -> LrSchedule:
    """A dsfunc lr schedule per parameter group equal to a freshly built torch lr scheduler: a function
    of a group's lr (its ``base_lrs`` entry) returning that group's :data:`~dsfunc.schedules.Schedule`.

    ``t`` is DeepSpeed's counter (the k-th applied step uses ``schedule(k - 1)``), so the k-th step
    uses the lr torch's scheduler would give after ``k`` calls of ``step()``. Supports LambdaLR (one
    function for every group; it runs on the host, a sync per step on GPU), StepLR, MultiStepLR,
    ExponentialLR, CosineAnnealingLR, LinearLR and ConstantLR (their closed forms).
    """
    sch = torch.optim.lr_scheduler
    kind = type(sched)
    name = _public_name(kind)
    if kind is sch.ReduceLROnPlateau:
        raise InputTypeError(
            f"lr_scheduler: a {name} cannot be translated: it follows a validation metric, while dsfunc's lr "
            "is a function of the step count. Use a step-based scheduler or a config \"scheduler\" section"
        )
    if getattr(sched, "last_epoch", None) != 0:
        raise InputError(
            f"lr_scheduler: the client {kind.__qualname__} has already been stepped (last_epoch="
            f"{getattr(sched, 'last_epoch', None)}); pass a fresh one and resume with engine.load_checkpoint"
        )
    if kind is sch.LambdaLR:
        fns = sched.lr_lambdas
        if any(f is not fns[0] for f in fns):
            raise InputError("lr_scheduler: LambdaLR with a different function per param group; use one function")
        fn = fns[0]

        def lambda_schedule(base: float) -> Schedule:
            return lambda t: torch.tensor(base * fn(int(t) + 1), dtype=torch.float32, device=t.device)

        return lambda_schedule
    if kind is sch.CosineAnnealingLR:
        t_max, eta_min = sched.T_max, sched.eta_min

        def cosine(base: float) -> Schedule:
            def schedule(t: torch.Tensor) -> torch.Tensor:
                k = (t + 1).to(torch.float64)
                return (eta_min + (base - eta_min) * (1 + torch.cos(math.pi * k / t_max)) / 2).to(torch.float32)

            return schedule

        return cosine
    factor = _closed_form(sched)
    if factor is None:
        raise InputTypeError(
            f"lr_scheduler: a {name} cannot be translated to a dsfunc schedule; use LambdaLR, StepLR, "
            "MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR or ConstantLR, or a config "
            '"scheduler" section (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)'
        )
    return lambda base: lambda t: (base * factor((t + 1).to(torch.float64))).to(torch.float32)


def client_schedule(lr_scheduler: Any, client_opt: Any,
                    groups: list[tuple[list[torch.Tensor], float]]) -> tuple[LrSchedule | None, Any]:
    """The per-group schedule of a client lr scheduler (or of a callable ``f(optimizer)``, which gets the
    client optimizer, or a stand-in carrying the engine's ``groups`` as ``(params, lr)``), and the torch
    scheduler itself (the one the callable built). A scheduler built on another optimizer has no schedule
    (None: the optimizer's lr stays), as with DeepSpeed, which steps it to no effect."""
    scheduler, given_opt = lr_scheduler, client_opt
    if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler) and not hand_built(lr_scheduler):
        if not callable(lr_scheduler):
            raise InputTypeError(
                f"lr_scheduler must be a torch lr scheduler or a callable, got {type(lr_scheduler).__name__}"
            )
        target = client_opt
        if target is None:  # a stand-in torch optimizer carrying the groups' lrs, for the callable to use
            target = torch.optim.SGD([{"params": params, "lr": lr} for params, lr in groups])
        scheduler = lr_scheduler(target)
        client_opt = target
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and not hand_built(scheduler):
            raise InputTypeError(f"the lr_scheduler callable returned a {type(scheduler).__name__}, not a torch lr scheduler")
    if hand_built(scheduler) and client_opt is not None and scheduler.optimizer is client_opt:
        if given_opt is None:
            raise InputError(f"lr_scheduler: a {type(scheduler).__name__} built on the engine's optimizer; describe it "
                             f'in the config\'s "scheduler" section ({{"type": "{type(scheduler).__name__}", ...}})')
        if scheduler.get_mom() is not None:
            raise InputError("lr_scheduler: a OneCycle cycling the client optimizer's betas; the engine follows a client "
                             "scheduler's lr only. Pass cycle_momentum=False, or describe it in the config's "
                             '"scheduler" section ({"type": "OneCycle", ...}), which cycles betas too')
        return (lambda base: None), scheduler  # DeepSpeed's own class: the engine steps it and follows its lr
    if client_opt is None or getattr(scheduler, "optimizer", None) is not client_opt:
        # DeepSpeed keeps it and steps it, and its lr reaches no parameter: the engine's lr stays the optimizer's
        logger.warning("lr_scheduler was built on a torch optimizer the engine does not use: the engine steps it, as "
                       "DeepSpeed's does, but the lr it sets trains nothing (pass that optimizer as optimizer= too, or "
                       "a callable lr_scheduler(optimizer))")
        return None, scheduler
    try:
        return schedule_from_torch(scheduler), scheduler
    except InputTypeError:
        if given_opt is None or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise
        # no closed form (OneCycleLR, a class of the client's own): the engine steps it after each applied step and
        # follows the lr it writes into the client optimizer's param_groups, as DeepSpeed does
        return (lambda base: None), scheduler
