"""``deepspeed.initialize``: build the engine for a model from a DeepSpeed config.

It joins the process group the environment describes, reads the config (``config=`` or
``args.deepspeed_config``), translates a client torch optimizer and scheduler, freezes the parameters
left out of ``model_parameters``, builds the state with :func:`dsfunc.init_state` and wraps it in the
:class:`~dsfunc.deepspeed.engine.Engine`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dsfunc.config import Config, mesh_sections
from dsfunc.data import DistributedLoader, check_dataset
from dsfunc.deepspeed import expert_groups
from dsfunc.deepspeed.arguments import config_source
from dsfunc.deepspeed.autotp import batch_config, check_recorded
from dsfunc.deepspeed.engine import Engine
from dsfunc.deepspeed.groups import Groups, freeze_all_but, labelled, parameter_groups
from dsfunc.deepspeed.moe_layer import bind_all
from dsfunc.deepspeed.pipe import PipelineModule
from dsfunc.deepspeed.pipe_engine import PipelineEngine
from dsfunc.deepspeed.translate import (
    ClientObjectError,
    check_fresh,
    client_schedule,
    drop_empty_groups,
    optimizer_section,
    translatable,
    zero_tested,
)
from dsfunc.deepspeed.ulysses_sp import SequenceParallelGroups
from dsfunc.deepspeed.views import EngineLRScheduler, EngineOptimizer, group_views
from dsfunc.distributed import comm
from dsfunc.distributed.process_group import init_distributed, join_world
from dsfunc.errors import InputError, InputTypeError
from dsfunc.init import init_state
from dsfunc.optim.base import chain
from dsfunc.optim.from_config import LrSchedule

logger = logging.getLogger("dsfunc")


class InitializeArgumentError(InputError, AssertionError):
    """An argument of ``initialize`` that DeepSpeed refuses with an assertion (scripts catch ``AssertionError``)."""


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    *,
    seed: int = 0,
    progress_bar: bool = False,
    total_steps: int | None = None,
) -> tuple[Engine, EngineOptimizer | None, DistributedLoader | None, EngineLRScheduler | None]:
    """DeepSpeed's ``deepspeed.initialize``: build the engine for ``model``.

    Args:
      args: an ``argparse.Namespace``; its ``deepspeed_config`` (from :func:`add_config_arguments`) is
        the config unless ``config`` is given (giving both, or neither, is an error).
      model: the ``nn.Module`` to train (it may live on ``meta``; see :func:`dsfunc.init_state`).
      optimizer: a fresh ``torch.optim`` Adam/AdamW/SGD/Adagrad (translated, its param groups with their own
        options), a DeepSpeed optimizer class (``deepspeed.ops.adam.FusedAdam``, ...), any other
        ``torch.optim.Optimizer`` (its own ``step()`` runs on the fp32 shards; under ZeRO only with
        ``zero_allow_untested_optimizer``, as DeepSpeed), or a callable ``f(params) -> optimizer``; it
        replaces the config's ``optimizer`` section. None uses the config's. Empty param groups are dropped.
      model_parameters: the parameters to train (a list, generator or filter), or a list of param-group
        dicts with their own options (``lr``, ``betas``, ``eps``, ``weight_decay``, ...), as torch.optim
        takes them; the model's other parameters are frozen. None trains every parameter with
        ``requires_grad``.
      training_data: a map-style ``torch.utils.data.Dataset``; the engine then returns a
        :class:`~dsfunc.data.DistributedLoader` of this rank's micro-batches.
      lr_scheduler: a fresh torch lr scheduler built on ``optimizer``, or a callable ``f(optimizer)``;
        it replaces the config's ``scheduler`` section. One built on another optimizer is kept and stepped
        to no effect on the lr, as DeepSpeed does (with a warning).
      distributed_port: MASTER_PORT when the environment does not set one.
      mpu: the groups ``UlyssesSPAttentionHF.register_with_transformers`` returns (Ulysses), or None.
      mesh_param: not supported (must be None).
      dist_init_required: False says the script has initialised torch.distributed itself: without a process
        group it is an error (:func:`dsfunc.init_distributed`), as DeepSpeed's.
      collate_fn: builds micro-batches from samples of ``training_data``.
      config, config_params: the DeepSpeed config (dict, JSON path, base64 JSON, or ``dsfunc.Config``).
      seed: dropout seed (kept in the state across checkpoints).
      progress_bar, total_steps: a tqdm bar on rank 0 (see :class:`dsfunc.monitor.Monitor`).

    Returns:
      ``(engine, optimizer, training_dataloader, lr_scheduler)``, as DeepSpeed returns them: the client's
      torch optimizer itself at ZeRO 0 in fp32, else a view of the engine's update (its ``optimizer`` the
      client's, as DeepSpeed's wrappers); the client's lr scheduler itself (the engine steps it after each
      applied step), else a view of the engine's schedule; None when there is none; the loader None without
      ``training_data``.
    """
    _check_arguments(args, model, mpu, mesh_param, config, config_params)
    source = config_source(args, config if config is not None else config_params)
    if dist_init_required is False:
        init_distributed(dist_init_required=False)
    else:
        join_world(distributed_port)
    local_rank = _local_rank(args)
    pipelined = isinstance(model, PipelineModule)
    mesh = mpu.mesh if mpu is not None else None  # register_with_transformers' (Ulysses)
    tensor, sp, _ = mesh_sections(source)
    sp = mesh.size("sp") if mesh is not None else sp  # DeepSpeed counts the mpu's sp ranks out of the batch
    check_recorded(model, tensor.autotp_size)  # deepspeed.tp_model_init's tp size (HF Trainer calls it)
    # the data-parallel ranks (a world the mesh does not divide is init_state's error)
    world = comm.world_size() // ((model.num_stages if pipelined else sp) * tensor.size) or comm.world_size()
    cfg = batch_config(source, world, 1 if pipelined else tensor.size)
    _check_unmanaged(cfg, pipelined)
    if training_data is not None:
        check_dataset(training_data)

    groups = parameter_groups(model_parameters) if model_parameters is not None else None
    cfg, groups, client_lr, client_opt, client_sched = _with_client_objects(cfg, optimizer, lr_scheduler, groups,
                                                                            model)
    if groups is not None:
        freeze_all_but(model, [p for params, _ in groups for p in params],
                       "the client optimizer" if client_opt is not None else "model_parameters")
    own_step = client_opt if client_opt is not None and cfg.optimizer is None else None  # see translatable
    trains = cfg.optimizer is not None or own_step is not None
    param_groups = labelled(model, groups) if groups is not None and trains else None
    update = own_step if own_step is not None else None if trains else chain()  # without optimizer: evaluates
    bind_all(model)  # each MoE layer's expert groups, in DeepSpeed's registry (deepspeed.utils.groups)
    if mpu is not None:  # ... and the mpu, as DeepSpeed's engine records it there
        expert_groups.mpu = mpu
    state = init_state(model, cfg, optimizer=update, seed=seed, in_place=True, param_groups=param_groups,
                       lr_schedule=client_lr, mesh=mesh)
    loader = None
    if training_data is not None:
        cuda = state.program.device.type == "cuda"
        loader = DistributedLoader(
            training_data, cfg.train_micro_batch_size_per_gpu, rank=state.program.mesh.group("dp").rank,
            world_size=state.program.mesh.size("dp"),
            shuffle=not pipelined,  # DeepSpeed's pipeline engine reads its data in order
            drop_last=cfg.dataloader_drop_last, collate_fn=collate_fn, num_workers=2 if cuda else 0,
            pin_memory=cuda,
        )
    views = group_views(state, param_groups, client_lr) if trains else None
    shared = client_opt.param_groups if client_opt is not None and views is not None else None
    engine_class = PipelineEngine if pipelined else Engine
    engine = engine_class(state, model=model, local_rank=local_rank, groups=views, param_groups=shared,
                          scheduled=client_lr is not None or cfg.scheduler is not None, training_dataloader=loader,
                          progress_bar=progress_bar, total_steps=total_steps)
    engine.client_optimizer, engine.client_lr_scheduler = optimizer, lr_scheduler
    engine.training_data, engine.collate_fn = training_data, collate_fn
    if client_sched is not None:  # DeepSpeed's engine steps the client's scheduler itself (the one a callable built)
        engine.lr_scheduler = client_sched
        engine.optimizer.driven = client_opt is not None and client_sched.optimizer is client_opt  # it writes our lr
    returned = engine.optimizer
    if engine.optimizer is not None and client_opt is not None:
        engine.optimizer.optimizer = client_opt
        if cfg.zero_optimization.stage == 0 and cfg.compute_dtype == torch.float32:
            returned = client_opt  # DeepSpeed wraps a client optimizer only for ZeRO or 16-bit training
    return engine, returned, engine.training_dataloader, engine.lr_scheduler


def _check_arguments(args: Any, model: Any, mpu: Any, mesh_param: Any, config: Any, config_params: Any) -> None:
    if model is None:
        given = " (the module was passed as the first positional argument, which is args)" if isinstance(
            args, nn.Module) else ""
        raise InitializeArgumentError(f"initialize needs the model to train{given}: "
                                      "deepspeed.initialize(model=net, ...)")
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None and not isinstance(mpu, SequenceParallelGroups) or mesh_param is not None:
        raise InputError("model parallelism through mpu= (other than the groups UlyssesSPAttentionHF."
                         "register_with_transformers returns) or mesh_param= is not supported by dsfunc; pass None")
    if config is not None and config_params is not None:
        raise InputError("pass the config as config= only (config_params= is its deprecated name)")


def _check_unmanaged(cfg: Config, pipelined: bool) -> None:
    """What DeepSpeed refuses with ``managed_gradient_accumulation`` false: overlap_comm below ZeRO-2 (its
    reduction would start before the script says where the step ends) and pipelines (they own the boundary)."""
    if cfg.managed_gradient_accumulation:
        return
    zero = cfg.zero_optimization
    if zero.overlap_comm and zero.stage < 2:
        raise InitializeArgumentError("managed_gradient_accumulation false supports ZeRO overlap_comm only with ZeRO "
                                      f"stage 2 or 3; set zero_optimization.overlap_comm false at stage {zero.stage}")
    if pipelined:
        raise InitializeArgumentError("managed_gradient_accumulation false is not supported with pipeline parallelism, "
                                      "whose engine ends each step itself; remove the key")


def _with_client_objects(cfg: Config, optimizer: Any, lr_scheduler: Any, groups: Groups | None,
                         model: nn.Module) -> tuple[Config, Groups | None, LrSchedule | None, Any, Any]:
    """The config with a client torch optimizer translated into its ``optimizer`` section (and the
    parameter groups it holds), and a client lr scheduler translated into a per-group schedule (its
    section dropped).

    Returns ``(config, parameter groups or None, client schedule or None, the client torch optimizer or
    None, the client torch lr scheduler or None)``.
    """
    client_opt = optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise InputTypeError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
        trainable = [p for p in model.parameters() if p.requires_grad]
        client_opt = optimizer([{"params": ps, **o} for ps, o in groups] if groups is not None else trainable)
        if not isinstance(client_opt, torch.optim.Optimizer):
            raise InputTypeError(f"the optimizer callable returned a {type(client_opt).__name__}, not a torch optimizer")
    raw = dict(cfg.raw)
    if client_opt is not None:
        drop_empty_groups(client_opt)
        _check_untested(cfg, client_opt)
        if translatable(client_opt):
            section, in_opt = optimizer_section(client_opt)
            raw["optimizer"] = section
        else:  # its own step() runs on the shards
            check_fresh(client_opt)
            in_opt = [(list(g["params"]), {}) for g in client_opt.param_groups]
            raw.pop("optimizer", None)
        if groups is not None and {id(p) for ps, _ in groups for p in ps} != {id(p) for ps, _ in in_opt for p in ps}:
            raise InputError("model_parameters and the client optimizer's parameters differ; pass the same set")
        groups = in_opt
        if cfg.optimizer is not None:
            logger.warning("the client optimizer passed to initialize replaces the config's optimizer section")
    client_lr = client_sched = None
    if lr_scheduler is not None:
        if client_opt is None and cfg.optimizer is None:
            raise InputError("a client lr_scheduler needs an optimizer: configure one or pass optimizer=")
        base = cfg.optimizer.params["lr"] if client_opt is None else None
        trainable = [([p for p in model.parameters() if p.requires_grad], {})]
        stand_in = [(ps, o.get("lr", base)) for ps, o in (groups if groups is not None else trainable)]
        client_lr, client_sched = client_schedule(lr_scheduler, client_opt, stand_in)
        raw.pop("scheduler", None)
        if cfg.scheduler is not None:
            logger.warning("the client lr_scheduler passed to initialize replaces the config's scheduler section")
    offload = cfg.zero_optimization.offload_optimizer
    if offload is not None and offload.micro_batches_per_backward > 1:
        logger.warning("offload_optimizer.micro_batches_per_backward has no effect under the engine, whose script "
                       "runs each micro-batch's backward itself; dsfunc.train_step honours it")
    if offload is not None and offload.speculative_update:
        logger.warning("offload_optimizer.speculative_update (or super_offload) has no effect under the engine, "
                       "whose step is not known before the script's last backward; dsfunc.train_step honours it")
    return Config.load(raw, world_size=cfg.world_size), groups, client_lr, client_opt, client_sched


def _check_untested(cfg: Config, optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed runs a client optimizer it has not tested (torch's SGD, RMSprop, a class of the client's own)
    under ZeRO only with ``zero_allow_untested_optimizer``."""
    if cfg.zero_optimization.stage > 0 and not cfg.zero_allow_untested_optimizer and not zero_tested(optimizer):
        raise ClientObjectError(
            f"the client optimizer is a {type(optimizer).__qualname__}, which DeepSpeed has not tested with ZeRO; "
            'add "zero_allow_untested_optimizer": true to the config to use it (its step() then runs on the '
            "fp32 shards of each parameter group)"
        )


def _local_rank(args: Any) -> int:
    """``LOCAL_RANK`` from the environment, checked against (and written to) ``args.local_rank``."""
    env = os.environ.get("LOCAL_RANK")
    given = getattr(args, "local_rank", None) if args is not None else None
    if env is not None and isinstance(given, int) and given >= 0 and given != int(env):
        raise InputError(f"Mismatch in local rank setting, args.local_rank={given} but env['LOCAL_RANK']={env}")
    local = int(env) if env is not None else (given if isinstance(given, int) and given >= 0 else 0)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local
    return local
