"""Building a training state (:func:`init_state`) and reading its weights back (:func:`full_params`).

A state has two halves. The data half is the :class:`~dsfunc.TrainState`'s leaves. The static half is
its :class:`Program`: what never changes during a run and is never checkpointed as tensors — the
parsed config, the model skeleton, the sharding plan, the update, the loss scaler's rule and the
composed step. The program's one mutable member is its :class:`~dsfunc.zero.gather.Workspace`, the
run's cache of compute copies (see there).

The skeleton is a hook-free copy of the user's module by default: the functional API leaves the module
it was given alone (``model.load_state_dict(dsfunc.full_params(state))`` brings the weights back).
With ``in_place=True`` — what the DeepSpeed engine passes, since in DeepSpeed the model passed in *is*
the engine's module — the skeleton is the module itself: its parameters become resident views of the
state's compute copies (:mod:`dsfunc.zero.binding`), so it holds the trained values after every step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dsfunc.config import Config
from dsfunc.dist import comm
from dsfunc.errors import InputError
from dsfunc.frozen import FrozenDict
from dsfunc.grad import LossFn
from dsfunc.optim.base import Transform, multi_transform
from dsfunc.optim.from_config import LrSchedule, update_from_config
from dsfunc.optim.fused import FusedAdam
from dsfunc.optim.groups import ParamGroups
from dsfunc.optim.update import ChainUpdate
from dsfunc.scaling import LossScaler
from dsfunc.state import Metrics, TrainState
from dsfunc.step import make_train_step
from dsfunc.zero.binding import Slots
from dsfunc.zero.gather import Workspace
from dsfunc.zero.hooks import install_input_cast, install_unit_hooks
from dsfunc.zero.layout import ShardingPlan, make_plan, unit_views
from dsfunc.zero.materialize import materialize
from dsfunc.zero.norms import segment_norm_fn

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: torch.float32}


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """Everything static about a run (identity-compared, so states of one run share a treedef)."""

    config: Config
    plan: ShardingPlan
    skeleton: nn.Module
    slots: Slots
    workspace: Workspace
    update: ChainUpdate | FusedAdam
    scaler: LossScaler
    loss_fn: LossFn | None
    device: torch.device
    compute_dtype: torch.dtype
    comm_dtype: torch.dtype
    persistent_buffers: tuple[str, ...]
    step_fn: Callable[..., TrainState]
    segment_norm: Callable[[Any], Any] | None = None


def init_state(
    model: nn.Module,
    config: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: Transform | ChainUpdate | FusedAdam | None = None,
    seed: int = 0,
    unit_modules: Sequence[str] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    in_place: bool = False,
    param_groups: ParamGroups | None = None,
    lr_schedule: LrSchedule | None = None,
) -> TrainState:
    """Build the training state for ``model`` as the DeepSpeed ``config`` describes.

    Args:
      model: the ``nn.Module`` to train. Every rank starts from rank 0's parameters and buffers (they
        are broadcast, as DeepSpeed does), so ranks need not seed alike. It may live on the ``meta``
        device, in which case each rank materialises only its own shard, one module at a time (with
        each module's ``reset_parameters()`` or ``param_init_fn(module)``, seeded by ``seed``, so every
        rank draws the same values), and no rank ever holds the whole model.
      config: a DeepSpeed config: dict, JSON path, ``argparse.Namespace`` with ``deepspeed_config``,
        or a :class:`dsfunc.Config`.
      loss_fn: ``loss_fn(model, batch) -> scalar``; without it the model's forward returns the loss.
      optimizer: an update transform replacing the config's optimizer section (or an update made by
        :func:`dsfunc.optim.update_from_config`); with ``param_groups``, a mapping group -> transform
        (optax's ``multi_transform``).
      seed: seeds dropout (and meta-device initialisation); the state carries it across resume.
      unit_modules: module paths to shard as units (default: blocks of the largest ModuleList).
      param_init_fn: initialises a module materialised from ``meta`` (in place).
      device: where the state lives (default: the current CUDA device, else the CPU).
      in_place: train ``model`` itself instead of a copy. Its parameters become views of the state's
        compute copies on ``device`` (in the compute dtype; at ZeRO-3 empty outside a forward, as in
        DeepSpeed: a forward through ``model`` gathers what it runs), its buffers the state's own, so
        ``model`` holds the current weights after every step with no copy. Parameter objects keep
        their identity unless they were on ``meta``.
      param_groups: optimizer options per group of parameters, the groups named by a label function
        over parameter names (:class:`dsfunc.ParamGroups`), e.g. no weight decay on biases and norms.
      lr_schedule: ``lr_schedule(group_lr) -> Schedule`` replaces the config's scheduler section, once
        per parameter group.

    Returns:
      A :class:`TrainState`; every rank of the process group must call this. Unless ``in_place``,
      ``model`` itself is only read: the state trains a skeleton copy of it.
    """
    cfg = Config.load(config, world_size=comm.world_size())
    device = torch.device(device) if device is not None else _default_device()
    zero = cfg.zero_optimization
    plan, groups = _plan(model, zero.stage, unit_modules, param_groups)
    skeleton = model if in_place else make_skeleton(model)
    params, buffers = materialize(model, skeleton, plan, device, seed, param_init_fn)
    slots = Slots(skeleton, plan, buffers.keys())
    scaler = LossScaler.from_config(cfg.fp16)
    update = _update(cfg, plan, optimizer, param_groups, groups, lr_schedule)
    workspace = Workspace(
        plan, slots=slots, compute_dtype=cfg.compute_dtype, device=device,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        max_live_elements=zero.stage3_max_live_parameters,
        prefetch=zero.overlap_comm and zero.stage3_prefetch_bucket_size > 0,
    )
    _hook(skeleton, workspace, cfg.compute_dtype)
    program = Program(
        config=cfg, plan=plan, skeleton=skeleton, slots=slots,
        workspace=workspace, update=update, scaler=scaler, loss_fn=loss_fn, device=device,
        compute_dtype=cfg.compute_dtype, comm_dtype=_COMM_DTYPES[cfg.communication_data_type],
        persistent_buffers=tuple(k for k in model.state_dict() if k in buffers),
        step_fn=make_train_step(), segment_norm=segment_norm_fn(plan, device),
    )
    state = _first_state(program, params, buffers, seed)
    workspace.refresh(state.params)
    slots.restore(state.buffers)
    return state


def _first_state(program: Program, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 seed: int) -> TrainState:
    """Step 0: fresh optimizer and loss-scaler states, zero metrics."""
    device = program.device
    zero_scalar = torch.zeros((), device=device)
    scaler_state = program.scaler.init(device)
    return TrainState(
        step=torch.zeros((), dtype=torch.int64),
        params=FrozenDict(params),
        opt_state=program.update.init(params),
        scaler=scaler_state,
        buffers=FrozenDict(buffers),
        rng=torch.tensor([seed], dtype=torch.int64),
        metrics=Metrics(loss=zero_scalar.clone(), grad_norm=zero_scalar.clone(),
                        loss_scale=scaler_state.scale.clone(), lr=zero_scalar.clone(),
                        skipped=torch.zeros((), dtype=torch.int32, device=device)),
        program=program,
    )


def _plan(model: nn.Module, stage: int, unit_modules: Sequence[str] | None,
          param_groups: ParamGroups | None) -> tuple[ShardingPlan, list[str]]:
    """The sharding plan, with units split by parameter group when there are several groups, and the
    groups in order."""
    groups = param_groups.order(n for n, p in model.named_parameters() if p.requires_grad) if param_groups else []
    plan = make_plan(model, stage=stage, world_size=comm.world_size(), rank=comm.rank(), unit_modules=unit_modules,
                     labels=param_groups.label_of if len(groups) > 1 else None)
    return plan, groups


def _hook(skeleton: nn.Module, workspace: Workspace, dtype: torch.dtype) -> None:
    """Install the skeleton's module hooks; a module trained in place before drops the hooks of that state,
    which this one replaces."""
    for handle in getattr(skeleton, "_dsfunc_hooks", ()):
        handle.remove()
    skeleton._dsfunc_hooks = install_unit_hooks(skeleton, workspace) + install_input_cast(skeleton, workspace, dtype)


def _update(cfg: Config, plan: ShardingPlan, optimizer: Any, param_groups: ParamGroups | None, groups: list[str],
            lr_schedule: LrSchedule | None) -> ChainUpdate | FusedAdam:
    """The update the program applies: the config's (per parameter group), or the one given."""
    unit_groups = {u.name: u.label for u in plan.units}
    if optimizer is None:
        options = None
        if groups:
            opts = param_groups.options
            options = {None: opts.get(groups[0], {})} if len(groups) == 1 else {g: opts.get(g, {}) for g in groups}
        return update_from_config(cfg, lr_schedule, group_options=options, unit_groups=unit_groups)
    if param_groups is not None and param_groups.options or lr_schedule is not None:
        raise InputError(
            "param_groups options and lr_schedule configure the config's optimizer; with optimizer= give "
            "each group its own transform instead: optimizer={label: transform, ...}"
        )
    if isinstance(optimizer, Mapping):
        missing = sorted(set(groups) - set(optimizer))
        if param_groups is None or missing:
            raise InputError(f"optimizer={{label: transform}} needs param_groups= naming the groups and a "
                             f"transform for each of them (missing: {missing})")
        transform = optimizer[groups[0]] if len(groups) == 1 else multi_transform(dict(optimizer), unit_groups)
        return ChainUpdate(transform)
    return optimizer if isinstance(optimizer, (ChainUpdate, FusedAdam)) else ChainUpdate(optimizer)


def make_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta`` and with no user hooks."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    skeleton = copy.deepcopy(model, memo)
    for module in skeleton.modules():
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                      "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            if hasattr(module, hooks):
                getattr(module, hooks).clear()
    skeleton.train()
    return skeleton


def full_params(state: TrainState) -> dict[str, torch.Tensor]:
    """A full, unsharded fp32 ``state_dict`` (parameters and persistent buffers) for the user's module.

    Every rank must call it (it all-gathers the shards); each gets the whole dictionary.
    """
    state.check_usable()
    program: Program = state.program
    plan = program.plan
    out: dict[str, torch.Tensor] = {}
    for unit in plan.units:
        shard = state.params[unit.name]
        flat = torch.empty(plan.padded_size(unit), dtype=torch.float32, device=shard.device)
        comm.all_gather_flat(flat, shard) if plan.ways > 1 else flat.copy_(shard)
        for slot, view in zip(unit.params, unit_views(unit, flat)):
            for alias in slot.aliases:
                out[alias] = view.clone()
    for name in program.persistent_buffers + plan.frozen:
        out[name] = state.buffers[name].detach().clone()
    order = [k for k, _ in program.skeleton.state_dict(keep_vars=True).items()]
    return {k: out[k] for k in order if k in out}


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
