"""The one place a DeepSpeed config becomes an update: lr schedule, optimizer chain, fused or not.

``update_from_config(cfg)`` is what :func:`dsfunc.init_state` and the DeepSpeed engine train with:
unscale, clip by the global norm, then the configured optimizer under the configured lr schedule; the
config's Adam/AdamW runs as dsfunc's fused op instead (:mod:`dsfunc.optim.fused`), with the same state.
The sections are validated by :mod:`dsfunc.config` (the one table of DeepSpeed's keys); the functions
here that take a raw section validate it there too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dsfunc.config import (
    Config,
    ConfigError,
    OptimizerConfig,
    SchedulerConfig,
    parse_optimizer,
    parse_scheduler,
)
from dsfunc.errors import InputError
from dsfunc.optim.aliases import adagrad, adam, adamw, lamb, sgd
from dsfunc.optim.base import Transform, multi_transform, named_chain
from dsfunc.optim.fused import FusedAdam
from dsfunc.optim.groups import GROUP_METADATA, plain
from dsfunc.optim.low_precision import low_precision
from dsfunc.optim.low_precision_host import CHUNK, native_adam
from dsfunc.optim.muon import MatrixShards, muon_half
from dsfunc.optim.transforms import clip_by_global_norm, scale_by_factor
from dsfunc.optim.update import ChainUpdate
from dsfunc.schedules import (
    Schedule,
    lr_range_test,
    one_cycle,
    one_cycle_momentum,
    warmup_cosine_lr,
    warmup_decay_lr,
    warmup_lr,
)

_SCHEDULES = {
    "WarmupLR": warmup_lr,
    "WarmupDecayLR": warmup_decay_lr,
    "WarmupCosineLR": warmup_cosine_lr,
    "OneCycle": one_cycle,
    "LRRangeTest": lr_range_test,
}
_OPTIMIZERS = {"adam": adam, "adamw": adamw, "lamb": lamb, "sgd": sgd, "adagrad": adagrad}
_ELEMENTWISE = ("adam", "adamw", "sgd", "adagrad")  # optimizers whose update of an element reads that element alone
_NO_EFFECT = ("torch_adam",)  # picks DeepSpeed's implementation (torch vs fused Adam); the math is the same


LrSchedule = Callable[[float], "Schedule | None"]  # a parameter group's lr -> that group's lr schedule


def update_from_config(cfg: Config, schedule_for: LrSchedule | None = None, *,
                       group_options: Mapping[str | None, Mapping[str, Any]] | None = None,
                       unit_groups: Mapping[str, str | None] | None = None,
                       matrices: Mapping[str, MatrixShards] | None = None) -> ChainUpdate | FusedAdam:
    """The update ``cfg`` describes.

    Args:
      cfg: the config; its ``optimizer`` section gives every group's defaults.
      schedule_for: ``schedule_for(group_lr)`` is a group's lr schedule, replacing the config's ``scheduler``
        section (which, like DeepSpeed's schedulers, runs per group from the group's lr).
      group_options: label -> options overriding the optimizer's params for that parameter group (see
        :class:`~dsfunc.optim.groups.ParamGroups`); ``{None: options}`` (or None) is one group, whose
        state keeps the plain layout.
      unit_groups: unit name -> its group's label (a plan with groups splits units by group).
      matrices: unit name -> where its matrices lie in its flat shard (Muon, :mod:`dsfunc.optim.muon`); a
        group's ``use_muon`` option (True / False) says which half of a Muon config it is.
    """
    if cfg.optimizer is None:
        raise InputError(
            'the config has no "optimizer" section; add one, e.g. '
            '"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, or pass optimizer=... to init_state'
        )
    options = dict(group_options) if group_options else {None: {}}
    halves = {label: opts.get("use_muon") for label, opts in options.items()}
    sections = {label: group_section(cfg.optimizer, {k: v for k, v in opts.items() if k != "use_muon"}, label)
                for label, opts in options.items()}
    for label, section in sections.items():
        if section.type == "muon" and halves[label] is None:
            muon_half(section.params, None, None, None)  # raises: Muon's halves come from the parameters
        if section.type != "muon" and halves[label] is not None:
            raise InputError(
                f"parameter group {label!r} sets use_muon, which only a Muon optimizer reads, but the optimizer "
                f'is {cfg.optimizer.type!r}: remove use_muon from the group, or set "optimizer": {{"type": "Muon"}}'
            )
    momentum = None
    if schedule_for is None:
        schedule_for = lambda lr: lr_schedule_of(cfg, lr)  # the config's rule, per group
        momentum = _momentum_schedule(cfg.scheduler) if cfg.scheduler is not None else None
    schedules = {label: schedule_for(float(section.params["lr"])) for label, section in sections.items()}
    chains = {label: _optimizer_chain(section, schedules[label], momentum, halves[label], matrices)
              for label, section in sections.items()}
    groups = dict(unit_groups or {})
    optimizer = chains[None] if None in chains else multi_transform(chains, groups)
    low = cfg.bf16.bf16_master_weights_and_grads
    if low:  # masters (and moments) in bf16: the transform chain rounds them as it stores them, on device or host
        optimizer = low_precision(optimizer, cfg.bf16.rounding, states=cfg.bf16.bf16_optimizer_states)
    chain = named_chain(
        ("unscale", scale_by_factor("grad_scale")),
        ("clip", clip_by_global_norm(cfg.gradient_clipping)),
        ("optimizer", optimizer),
    )
    fused = None
    if momentum is None:
        fused = FusedAdam.from_sections(sections, schedules, groups, cfg.gradient_clipping, chain)
    if fused is not None and not low:
        return fused
    elementwise = all(s.type in _ELEMENTWISE for s in sections.values()) and cfg.bf16.rounding != "stochastic"
    native = native_adam(fused, cfg.bf16.rounding, cfg.bf16.bf16_optimizer_states) if low else None
    return ChainUpdate(chain, by_unit=low, max_norm=cfg.gradient_clipping, chunk=CHUNK if elementwise else 0,
                       native=native)


def group_section(base: OptimizerConfig, options: Mapping[str, Any], label: str | None) -> OptimizerConfig:
    """The optimizer section of one parameter group: ``base``'s params with the group's ``options``,
    validated as the config validates them (keys that only name a group, such as ``name``, are ignored)."""
    opts = {k: plain(v) for k, v in options.items() if k not in GROUP_METADATA}
    if not opts:
        return base
    try:
        return parse_optimizer({"type": base.type, "params": {**base.params, **opts}})
    except ConfigError as e:
        raise ConfigError(f"parameter group {label!r}: {e}") from None


def lr_schedule(cfg: Config) -> Schedule | None:
    """The config's lr schedule for the optimizer's own lr (``None`` without a scheduler section: the
    optimizer's constant lr)."""
    lr = cfg.optimizer.params["lr"] if cfg.optimizer is not None else None
    return lr_schedule_of(cfg, None if lr is None else float(lr))


def lr_schedule_of(cfg: Config, group_lr: float | None) -> Schedule | None:
    """The config's lr schedule for a parameter group whose lr is ``group_lr``, as DeepSpeed's schedulers
    set each group: WarmupLR without ``warmup_max_lr`` and WarmupCosineLR follow the group's lr; the
    others (WarmupLR with ``warmup_max_lr`` too) give every group the same lr."""
    if cfg.scheduler is None:
        return None
    return _schedule(cfg.scheduler, group_lr)


def optimizer_from_config(opt_cfg_type: str, params: Mapping[str, Any], schedule: Schedule | None,
                          *, momentum_schedule: Schedule | None = None) -> Transform:
    """A named optimizer from a DeepSpeed ``optimizer`` section's ``type`` and ``params``.

    Args:
        opt_cfg_type: "Adam", "AdamW", "SGD", "Lamb" or "Adagrad" (case-insensitive). "Adam" follows
            ``adam_w_mode`` (default True = decoupled); "AdamW" is always decoupled, as in DeepSpeed.
        params: the section's ``params`` with DeepSpeed's names (validated as the config validates them);
            missing ones take DeepSpeed's defaults.
        schedule: the lr schedule, which replaces ``params["lr"]``; None keeps the constant lr.
        momentum_schedule: a ``betas[0]`` schedule (:func:`momentum_schedule_from_config`). For
            optimizers with betas it replaces beta1 and, as DeepSpeed's OneCycle does, sets beta2 to 0.99;
            others ignore it (DeepSpeed disables momentum cycling when the optimizer has no betas).
    """
    section = parse_optimizer({"type": opt_cfg_type, "params": dict(params)})
    return _optimizer_chain(section, schedule, momentum_schedule)


def schedule_from_config(type: str, params: Mapping[str, Any], base_lr: float) -> Schedule:
    """The lr schedule of a DeepSpeed ``scheduler`` section (validated as the config validates it).

    Args:
        type: one of "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest".
        params: the section's ``params`` with DeepSpeed's names (missing ones take DeepSpeed's defaults).
        base_lr: the optimizer's configured lr (used by WarmupCosineLR, and by warmup_max_lr=None).
    """
    return _schedule(parse_scheduler({"type": type, "params": dict(params)}), base_lr)


def momentum_schedule_from_config(type: str, params: Mapping[str, Any]) -> Schedule | None:
    """The ``betas[0]`` schedule a DeepSpeed ``scheduler`` section implies: OneCycle with ``cycle_momentum``
    (DeepSpeed's default) cycles momentum; every other case returns None."""
    return _momentum_schedule(parse_scheduler({"type": type, "params": dict(params)}))


def _optimizer_chain(section: OptimizerConfig, schedule: Schedule | None, momentum: Schedule | None,
                     use_muon: bool | None = None, matrices: Mapping[str, MatrixShards] | None = None) -> Transform:
    if section.type == "muon":
        return muon_half(section.params, use_muon, schedule, matrices)
    kwargs = {k: v for k, v in section.params.items() if k not in _NO_EFFECT}
    if schedule is not None:
        kwargs["lr"] = schedule
    if momentum is not None and "betas" in kwargs:
        kwargs["betas"] = (momentum, 0.99)
    if section.type == "adamw":
        kwargs.pop("adam_w_mode")
    return _OPTIMIZERS[section.type](**kwargs)


def _schedule(section: SchedulerConfig, base_lr: float | None) -> Schedule:
    kwargs = {k: v for k, v in section.params.items() if k != "last_batch_iteration"}
    if section.type in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        kwargs["base_lr"] = base_lr
    return _SCHEDULES[section.type](**kwargs)


def _momentum_schedule(section: SchedulerConfig) -> Schedule | None:
    if section.type != "OneCycle" or not section.params["cycle_momentum"]:
        return None
    return one_cycle_momentum(**{k: v for k, v in section.params.items() if k != "last_batch_iteration"})
