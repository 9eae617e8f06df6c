"""DeepSpeed's engine API as a thin shell over a :class:`~dsfunc.TrainState`.

``import dsfunc as deepspeed`` runs scripts written for DeepSpeed's engine::

    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=net,
                                                                model_parameters=net.parameters(),
                                                                training_data=trainset)
    for inputs, labels in loader:
        loss = criterion(engine(inputs), labels)
        engine.backward(loss)
        engine.step()

The engine holds the current state (``engine.state``) and runs the same pieces as
:func:`dsfunc.train_step`: ``engine(...)`` binds the parameters into the model (gathering them at ZeRO
stage 3) and runs its forward; ``engine.backward(loss)`` runs autograd, reducing gradients over ranks
as the ZeRO stage says; ``engine.step()`` counts micro-batches and, at the accumulation boundary,
applies the update (:func:`dsfunc.apply_gradients`), which also advances the lr schedule unless the
step overflowed. The same config and data give the same parameters as the functional API.

Where dsfunc differs from DeepSpeed (each is a clear error or documented here):

* Call ``forward``, ``backward`` and ``step`` once each per micro-batch, in that order.
* ``engine.eval()`` or ``torch.no_grad()`` makes forwards evaluations: no graph, nothing to backward.
* ``engine.module`` is the model you passed, refreshed with the current weights when you read it: a
  gather of all parameters (every rank must read it at ZeRO stages 1-3) and a copy into the module,
  once per optimizer step. dsfunc trains its own copy, so the module's own parameters go stale between
  reads and writing to them changes nothing.
* ``model_parameters``: parameters of the model left out are frozen (``requires_grad`` set to False).
  Parameter groups with their own options are refused.
* A client ``torch.optim`` Adam/AdamW/SGD/Adagrad (or a callable returning one) is translated to
  dsfunc's update; a client ``torch.optim.lr_scheduler`` LambdaLR/StepLR/MultiStepLR/ExponentialLR/
  CosineAnnealingLR/LinearLR/ConstantLR too (closed forms; LambdaLR's function runs on the host each
  step). Anything else is refused with a message.
* ``load_checkpoint`` also moves the engine's ``training_dataloader`` to where the saved run was, so a
  resumed loop sees the same batches (do not skip batches by hand as well).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn

from dsfunc import checkpoint
from dsfunc.config import Config
from dsfunc.data import DistributedLoader, check_dataset
from dsfunc.dist import comm
from dsfunc.dist import init as distributed
from dsfunc.monitor import Monitor, tokens_in
from dsfunc.optim import (
    ScheduleState,
    chain,
    clip_by_global_norm,
    current_lr,
    named_chain,
    optimizer_from_config,
    scale_by_factor,
)
from dsfunc.program import full_params, init_state
from dsfunc.schedules import Schedule, schedule_from_config
from dsfunc.state import TrainState
from dsfunc.step import apply_gradients
from dsfunc.zero import ShardedBinding

logger = logging.getLogger("dsfunc")

ENGINE_KEY = "dsfunc_engine"  # engine counters inside a checkpoint's client state


# --------------------------------------------------------------------------------------------------
# command line


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags to ``parser``: ``--deepspeed``, ``--deepspeed_config`` and the deprecated
    ``--deepscale``, ``--deepscale_config``.

    Unlike DeepSpeed, it also adds ``--local_rank`` (alias ``--local-rank``, default ``$LOCAL_RANK`` or
    -1) when the parser has neither, so a script started by a launcher that appends ``--local_rank=N``
    does not fail on an unknown argument; a parser that defines its own keeps it. Returns ``parser``.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for user code; it changes nothing in dsfunc)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    if not any(flag in parser._option_string_actions for flag in ("--local_rank", "--local-rank")):
        group.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "-1")),
                           help="local rank set by a launcher (tolerated; dsfunc reads LOCAL_RANK)")
    return parser


def _config_source(args: Any, config: Any) -> Any:
    """The config from ``config=`` or ``args.deepspeed_config`` (exactly one of them)."""
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError(
                "both --deepscale_config and --deepspeed_config are set; keep --deepspeed_config only"
            )
        args.deepspeed_config = args.deepscale_config
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise ValueError(
            "a DeepSpeed config came both from args.deepspeed_config "
            f"({from_args!r}) and from initialize(config=...); pass only one of them"
        )
    if from_args is None and config is None:
        raise ValueError(
            "no DeepSpeed config: pass --deepspeed_config ds_config.json (add the flag to your parser with "
            "dsfunc.add_config_arguments(parser)) or initialize(config=<dict or path>)"
        )
    return config if config is not None else from_args


# --------------------------------------------------------------------------------------------------
# joining the process group


def _join_world(distributed_port: int) -> None:
    """Join the process group the environment describes (started by dsfunc, torchrun or mpirun); a process
    started alone needs none (world size 1)."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ or any(k in os.environ for k in distributed._MPI_MARKERS):
        distributed.init_distributed(distributed_port=distributed_port)


def _local_rank(args: Any) -> int:
    """``LOCAL_RANK`` from the environment, checked against (and written to) ``args.local_rank``."""
    env = os.environ.get("LOCAL_RANK")
    given = getattr(args, "local_rank", None) if args is not None else None
    if env is not None and isinstance(given, int) and given >= 0 and given != int(env):
        raise ValueError(f"Mismatch in local rank setting, args.local_rank={given} but env['LOCAL_RANK']={env}")
    local = int(env) if env is not None else (given if isinstance(given, int) and given >= 0 else 0)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local
    return local


# --------------------------------------------------------------------------------------------------
# which parameters train


def _parameter_list(model_parameters: Any) -> list[torch.Tensor]:
    """Flatten ``model_parameters`` (tensors, or param-group dicts without options) to a list."""
    out: list[torch.Tensor] = []
    for i, item in enumerate(model_parameters):
        if isinstance(item, dict):
            if "params" not in item:
                raise ValueError(f"model_parameters[{i}] is a dict without a 'params' entry")
            options = sorted(k for k in item if k != "params")
            if options:
                raise ValueError(
                    f"model_parameters[{i}] is a parameter group with its own options {options}; dsfunc "
                    "trains all parameters with the one optimizer configuration (per-group options are "
                    "not supported). Pass a flat list of parameters; leave out the ones that should not train."
                )
            params = item["params"]
            out.extend([params] if isinstance(params, torch.Tensor) else list(params))
        elif isinstance(item, torch.Tensor):
            out.append(item)
        else:
            hint = " (model.named_parameters() gives (name, tensor) pairs; pass model.parameters())" \
                if isinstance(item, tuple) else ""
            raise TypeError(f"model_parameters[{i}] is a {type(item).__name__}, not a parameter{hint}")
    return out


def _freeze_all_but(model: nn.Module, trainable: list[torch.Tensor], what: str) -> None:
    """Set ``requires_grad=False`` on the model's parameters that are not in ``trainable``."""
    ids = {id(p) for p in trainable}
    named = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    strangers = [p for p in trainable if id(p) not in named]
    if strangers:
        raise ValueError(
            f"{what} holds {len(strangers)} tensor(s) that are not parameters of the model "
            f"(shapes {[tuple(p.shape) for p in strangers[:4]]}); pass parameters of the model you train"
        )
    frozen = [name for name, p in model.named_parameters() if id(p) not in ids and p.requires_grad]
    for name, p in model.named_parameters():
        if id(p) not in ids:
            p.requires_grad_(False)
    if frozen:
        logger.info("%s leaves out %d parameter(s); they are frozen: %s", what, len(frozen), frozen[:8])


# --------------------------------------------------------------------------------------------------
# client optimizers and schedulers


_TORCH_OPTIMIZERS: dict[type, tuple[str, tuple[str, ...]]] = {
    torch.optim.Adam: ("Adam", ("lr", "betas", "eps", "weight_decay")),
    torch.optim.AdamW: ("AdamW", ("lr", "betas", "eps", "weight_decay")),
    torch.optim.SGD: ("SGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
    torch.optim.Adagrad: ("Adagrad", ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")),
}
_IMPLEMENTATION_ONLY = ("foreach", "fused", "capturable", "differentiable")  # pick a kernel, not the math


def _public_name(cls: type) -> str:
    """``torch.optim.RMSprop`` rather than ``torch.optim.rmsprop.RMSprop``."""
    module = cls.__module__
    if module.startswith("torch.optim.") and module != "torch.optim.lr_scheduler":
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def optimizer_section(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The DeepSpeed ``optimizer`` config section equivalent to a fresh torch optimizer.

    Maps ``torch.optim.Adam`` (L2, or decoupled with ``decoupled_weight_decay``), ``AdamW``, ``SGD`` and
    ``Adagrad``; options that only choose an implementation (``foreach``, ``fused``, ...) are ignored;
    any other option away from torch's default (``amsgrad``, ``maximize``, ...) is refused.
    """
    kind = type(optimizer)
    if kind not in _TORCH_OPTIMIZERS:
        raise TypeError(
            f"optimizer: a {_public_name(kind)} cannot be translated to a dsfunc update; "
            "pass a torch.optim.Adam, AdamW, SGD or Adagrad (or a callable returning one), or leave "
            'optimizer out and describe it in the config\'s "optimizer" section (Adam, AdamW, SGD, Lamb, Adagrad)'
        )
    name, hyper = _TORCH_OPTIMIZERS[kind]
    if _has_stepped(optimizer):
        raise ValueError(
            f"the client torch.optim.{name} has state (it has taken steps or loaded a state_dict); dsfunc "
            "starts the optimizer from scratch. Pass a fresh optimizer and resume with engine.load_checkpoint"
        )
    groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for i, group in enumerate(groups[1:], 1):
        differ = sorted(k for k in set(group) | set(groups[0]) if group.get(k) != groups[0].get(k))
        if differ:
            raise ValueError(
                f"the client torch.optim.{name}'s param_groups differ in {differ} (group 0 vs group {i}); "
                "dsfunc trains all parameters with one set of hyper-parameters. Use a single group; freeze "
                "parameters that should not train (requires_grad=False)"
            )
    group = groups[0]
    defaults = {n: _plain(p.default) for n, p in inspect.signature(kind.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    params: dict[str, Any] = {"lr": group.get("initial_lr", group["lr"])}
    if name == "Adam":
        params["adam_w_mode"] = bool(group.get("decoupled_weight_decay", False))
    for key, value in group.items():
        if key in hyper:
            params.setdefault(key, value)
        elif key in _IMPLEMENTATION_ONLY or key in ("initial_lr", "decoupled_weight_decay"):
            continue
        elif key not in defaults or value != defaults[key]:
            raise ValueError(
                f"torch.optim.{name}({key}={value!r}) has no dsfunc equivalent; drop that option or describe "
                'the optimizer in the config\'s "optimizer" section'
            )
    return {"type": name, "params": params}


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


def schedule_from_torch(sched: Any) -> Schedule:
    """A dsfunc lr :data:`~dsfunc.schedules.Schedule` equal to a freshly built torch lr scheduler.

    ``t`` is DeepSpeed's counter (the k-th applied step uses ``schedule(k - 1)``), so the k-th step
    uses the lr torch's scheduler would give after ``k`` calls of ``step()``. Supports LambdaLR (one
    function for every group; it runs on the host, a sync per step on GPU), StepLR, MultiStepLR,
    ExponentialLR, CosineAnnealingLR, LinearLR and ConstantLR (their closed forms).
    """
    sch = torch.optim.lr_scheduler
    kind = type(sched)
    name = _public_name(kind)
    if kind is sch.ReduceLROnPlateau:
        raise TypeError(
            f"lr_scheduler: a {name} cannot be translated: it follows a validation metric, while dsfunc's lr "
            "is a function of the step count. Use a step-based scheduler or a config \"scheduler\" section"
        )
    if getattr(sched, "last_epoch", None) != 0:
        raise ValueError(
            f"lr_scheduler: the client {kind.__qualname__} has already been stepped (last_epoch="
            f"{getattr(sched, 'last_epoch', None)}); pass a fresh one and resume with engine.load_checkpoint"
        )
    bases = list(sched.base_lrs)
    if any(b != bases[0] for b in bases):
        raise ValueError(f"lr_scheduler: base learning rates differ between param groups ({bases}); use one group")
    base = float(bases[0])
    if kind is sch.LambdaLR:
        fns = sched.lr_lambdas
        if any(f is not fns[0] for f in fns):
            raise ValueError("lr_scheduler: LambdaLR with a different function per param group; use one function")
        fn = fns[0]

        def lambda_schedule(t: torch.Tensor) -> torch.Tensor:
            return torch.tensor(base * fn(int(t) + 1), dtype=torch.float32, device=t.device)

        return lambda_schedule
    if kind is sch.CosineAnnealingLR:
        t_max, eta_min = sched.T_max, sched.eta_min

        def cosine(t: torch.Tensor) -> torch.Tensor:
            k = (t + 1).to(torch.float64)
            return (eta_min + (base - eta_min) * (1 + torch.cos(math.pi * k / t_max)) / 2).to(torch.float32)

        return cosine
    factor = _closed_form(sched)
    if factor is None:
        raise TypeError(
            f"lr_scheduler: a {name} cannot be translated to a dsfunc schedule; use LambdaLR, StepLR, "
            "MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR or ConstantLR, or a config "
            '"scheduler" section (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)'
        )
    return lambda t: (base * factor((t + 1).to(torch.float64))).to(torch.float32)


def _update_transform(cfg: Config, schedule: Schedule) -> Any:
    """The config's update with the lr from ``schedule`` (the composition of ``dsfunc.init_state``)."""
    return named_chain(
        ("unscale", scale_by_factor("grad_scale")),
        ("clip", clip_by_global_norm(cfg.gradient_clipping)),
        ("optimizer", optimizer_from_config(cfg.optimizer.type, cfg.optimizer.params, schedule)),
    )


# --------------------------------------------------------------------------------------------------
# initialize


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
      optimizer: a fresh ``torch.optim`` Adam/AdamW/SGD/Adagrad, or a callable ``f(params) -> optimizer``;
        it replaces the config's ``optimizer`` section. None uses the config's.
      model_parameters: the parameters to train (a list, generator or filter); the model's other
        parameters are frozen. None trains every parameter with ``requires_grad``.
      training_data: a map-style ``torch.utils.data.Dataset``; the engine then returns a
        :class:`~dsfunc.data.DistributedLoader` of this rank's micro-batches.
      lr_scheduler: a fresh torch lr scheduler built on ``optimizer``, or a callable ``f(optimizer)``;
        it replaces the config's ``scheduler`` section.
      distributed_port: MASTER_PORT when the environment does not set one.
      mpu, mesh_param: model/sequence parallelism; not supported (must be None).
      dist_init_required: False skips joining the process group.
      collate_fn: builds micro-batches from samples of ``training_data``.
      config, config_params: the DeepSpeed config (dict, JSON path, base64 JSON, or ``dsfunc.Config``).
      seed: dropout seed (kept in the state across checkpoints).
      progress_bar, total_steps: a tqdm bar on rank 0 (see :class:`dsfunc.monitor.Monitor`).

    Returns:
      ``(engine, optimizer, training_dataloader, lr_scheduler)``: the optimizer and scheduler are views
      of the engine's (None when there is none), the loader None without ``training_data``.
    """
    if model is None:
        raise ValueError("initialize needs the model to train: deepspeed.initialize(model=net, ...)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ValueError("model/sequence parallelism (mpu=, mesh_param=) is not supported by dsfunc; pass None")
    if config is not None and config_params is not None:
        raise ValueError("pass the config as config= only (config_params= is its deprecated name)")
    source = _config_source(args, config if config is not None else config_params)
    if dist_init_required is not False:
        _join_world(distributed_port)
    local_rank = _local_rank(args)
    world = comm.world_size()
    cfg = Config.load(source, world_size=world)
    if training_data is not None:
        check_dataset(training_data)

    chosen = _parameter_list(model_parameters) if model_parameters is not None else None
    client_opt = optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
        client_opt = optimizer(chosen if chosen is not None else [p for p in model.parameters() if p.requires_grad])
        if not isinstance(client_opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned a {type(client_opt).__name__}, not a torch optimizer")
    raw = dict(cfg.raw)
    if client_opt is not None:
        in_opt = [p for g in client_opt.param_groups for p in g["params"]]
        if chosen is not None and {id(p) for p in chosen} != {id(p) for p in in_opt}:
            raise ValueError("model_parameters and the client optimizer's parameters differ; pass the same set")
        chosen = in_opt
        raw["optimizer"] = optimizer_section(client_opt)
        if cfg.optimizer is not None:
            logger.warning("the client optimizer passed to initialize replaces the config's optimizer section")
    client_schedule = None
    if lr_scheduler is not None:
        client_schedule = _client_schedule(lr_scheduler, client_opt, cfg, model)
        raw.pop("scheduler", None)
        if cfg.scheduler is not None:
            logger.warning("the client lr_scheduler passed to initialize replaces the config's scheduler section")
    cfg = Config.load(raw, world_size=world)
    if chosen is not None:
        _freeze_all_but(model, chosen, "model_parameters" if client_opt is None else "the client optimizer")

    base_lr = float(cfg.optimizer.params["lr"]) if cfg.optimizer is not None else None
    if cfg.optimizer is None:
        update, schedule = chain(), None  # an engine without optimizer only evaluates
    elif client_schedule is not None:
        update, schedule = _update_transform(cfg, client_schedule), client_schedule
    else:
        update = None  # init_state builds the config's
        schedule = schedule_from_config(cfg.scheduler.type, cfg.scheduler.params, base_lr) if cfg.scheduler else None
    state = init_state(model, cfg, optimizer=update, seed=seed)

    loader = None
    if training_data is not None:
        cuda = state.program.device.type == "cuda"
        loader = DistributedLoader(
            training_data, cfg.train_micro_batch_size_per_gpu, rank=comm.rank(), world_size=world,
            drop_last=cfg.dataloader_drop_last, collate_fn=collate_fn, num_workers=2 if cuda else 0,
            pin_memory=cuda,
        )
    engine = Engine(state, model=model, local_rank=local_rank, schedule=schedule, base_lr=base_lr,
                    training_dataloader=loader, progress_bar=progress_bar, total_steps=total_steps)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _client_schedule(lr_scheduler: Any, client_opt: Any, cfg: Config, model: nn.Module) -> Schedule:
    scheduler = lr_scheduler
    if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        if not callable(lr_scheduler):
            raise TypeError(
                f"lr_scheduler must be a torch lr scheduler or a callable, got {type(lr_scheduler).__name__}"
            )
        target = client_opt
        if target is None:  # a stand-in torch optimizer carrying the config's lr, for the callable to use
            if cfg.optimizer is None:
                raise ValueError("a client lr_scheduler needs an optimizer: configure one or pass optimizer=")
            target = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.optimizer.params["lr"])
        scheduler = lr_scheduler(target)
        client_opt = target
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(f"the lr_scheduler callable returned a {type(scheduler).__name__}, not a torch lr scheduler")
    if client_opt is None or getattr(scheduler, "optimizer", None) is not client_opt:
        raise ValueError(
            "lr_scheduler was built on a torch optimizer the engine does not use; pass that optimizer as "
            "optimizer= too, or pass a callable lr_scheduler(optimizer)"
        )
    return schedule_from_torch(scheduler)


# --------------------------------------------------------------------------------------------------
# the engine


class Engine:
    """DeepSpeed's ``DeepSpeedEngine`` over a :class:`~dsfunc.TrainState` (built by :func:`initialize`)."""

    def __init__(
        self,
        state: TrainState,
        *,
        model: nn.Module,
        local_rank: int = 0,
        schedule: Schedule | None = None,
        base_lr: float | None = None,
        training_dataloader: DistributedLoader | None = None,
        progress_bar: bool = False,
        total_steps: int | None = None,
    ) -> None:
        self._state = state
        self._model = model
        self._schedule = schedule
        self._base_lr = base_lr
        self.local_rank = local_rank
        self.training_dataloader = training_dataloader
        program = state.program
        self.config = program.config
        self.global_rank = program.plan.rank
        self.world_size = program.plan.world_size
        self.monitor = Monitor(state, progress_bar=progress_bar, total_steps=total_steps)
        self.optimizer = EngineOptimizer(self) if base_lr is not None else None
        self.lr_scheduler = EngineLRScheduler(self) if schedule is not None else None
        self.micro_steps = 0
        self.global_samples = 0
        self.training = True
        self._phase = "idle"  # idle -> forward -> backward -> (step) idle
        self._binding: ShardedBinding | None = None
        self._restore_buffers: Callable[[], None] | None = None
        self._loss_sum: torch.Tensor | None = None
        self._timings: dict[str, float] = {}
        self._tokens = 0
        self._module_step: int | None = None

    # -- accessors --------------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """The current training state (replaced at every optimizer step; earlier ones are donated)."""
        return self._state

    @property
    def device(self) -> torch.device:
        return self._state.program.device

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped ones included."""
        return int(self._state.step)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients overflowed (reading it waits for the device)."""
        return self.monitor.skipped_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the current micro-batch is the last of its optimizer step."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        """The lr the next optimizer step will use, as a one-element list (DeepSpeed's per-group list)."""
        if self._base_lr is None:
            return []
        if self._schedule is None:
            return [self._base_lr]
        return [float(self._schedule(_schedule_count(self._state.opt_state) - 1))]

    def get_global_grad_norm(self) -> float:
        """The global gradient norm of the last optimizer step (unscaled, before clipping)."""
        return float(self._state.metrics.grad_norm)

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped for overflow."""
        return not bool(self._state.metrics.skipped)

    def zero_grad(self) -> None:
        """Nothing to do: gradients never live on the module's parameters (kept for DeepSpeed scripts)."""

    def train(self, mode: bool = True) -> Engine:
        """Training mode: forwards with autograd enabled prepare a backward; the model runs in train mode."""
        self.training = mode
        self._state.program.skeleton.train(mode)
        return self

    def eval(self) -> Engine:
        """Evaluation mode: forwards build no graph and leave gradients alone; the model runs in eval mode."""
        return self.train(False)

    @property
    def module(self) -> nn.Module:
        """The model passed to ``initialize``, holding the current full parameters and buffers.

        Refreshed on read after each optimizer step: a gather of all parameters (at ZeRO stages 1-3 a
        collective, so every rank must read it) and a copy into the module; a model built on ``meta``
        gets real tensors (a full copy of the model on every rank). Treat it as a read-only snapshot.
        """
        state = self._state
        step = int(state.step)
        if self._module_step != step:
            weights = full_params(state)
            model = self._model
            on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
            model.load_state_dict(weights, assign=on_meta)
            for name, value in state.buffers.items():  # non-persistent buffers are not in a state_dict
                if name not in weights:
                    path, _, attr = name.rpartition(".")
                    owner = model.get_submodule(path) if path else model
                    where = value.device if owner._buffers[attr].is_meta else owner._buffers[attr].device
                    owner._buffers[attr] = value.detach().to(where, copy=True)
            self._module_step = step
        self._model.train(self.training)
        return self._model

    # -- the training loop ------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model on ``inputs`` (moved to the engine's device) with the current parameters.

        In training mode with autograd enabled, the outputs carry a graph for :meth:`backward`; in
        :meth:`eval` mode or under ``torch.no_grad()`` it is an evaluation.
        """
        if not (torch.is_grad_enabled() and self.training and self.optimizer is not None):
            return self._evaluate(inputs, kwargs)
        if self._phase == "forward":
            raise RuntimeError(
                "engine(...) was called again before engine.backward() for the previous forward: call "
                "engine.backward(loss) and engine.step() after each training forward (evaluate under "
                "torch.no_grad() or after engine.eval())"
            )
        if self._phase == "backward":
            raise RuntimeError("engine.step() must follow engine.backward() before the next forward")
        start = self._clock()
        state = self._state
        program = state.program
        gas = self.gradient_accumulation_steps()
        if self._binding is None:
            program.check_scaler(state)
            self._binding = ShardedBinding(program, state.params)
            self._loss_sum = None
        micro = self.micro_steps % gas
        inputs, kwargs = program.to_device((inputs, kwargs))
        self._tokens += tokens_in((inputs, kwargs))
        self._binding.begin_micro(micro, gas)
        self._restore_buffers = program.bind_buffers(state.buffers)
        try:
            with program.rng_scope(state, micro):
                out = program.skeleton(*inputs, **kwargs)
        except BaseException:
            self._abandon_step()
            raise
        self._phase = "forward"
        self._lap("forward", start)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` (computed from this micro-batch's forward) into the engine's gradients.

        The seed is ``loss * loss_scale / (gradient_accumulation_steps * world_size)``, so the step's
        gradient is the mean over all micro-batches of all ranks. Returns ``loss``.
        """
        if self.optimizer is None:
            raise RuntimeError(
                'engine.backward() needs an optimizer: add an "optimizer" section to the config or pass '
                "optimizer= to initialize"
            )
        if self._phase == "idle":
            raise RuntimeError(
                "engine.backward() without a training forward: run `loss = criterion(engine(inputs), labels)` "
                "first (forwards under torch.no_grad() or engine.eval() are evaluations and build no graph)"
            )
        if self._phase == "backward":
            raise RuntimeError("engine.backward() was already called for this forward; call engine.step() next")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"engine.backward() needs a scalar floating-point loss, got {what}")
        if loss.grad_fn is None:
            raise ValueError(
                "the loss has no graph (computed under torch.no_grad(), or detached); compute it from the "
                "outputs of the training forward engine(...)"
            )
        start = self._clock()
        state = self._state
        program = state.program
        cotangent = 1.0 * state.scaler.scale / program.plan.world_size
        if scale_wrt_gas:
            cotangent = cotangent / self.gradient_accumulation_steps()
        binding = self._binding
        try:
            if not binding.leaves:
                raise ValueError("the forward used no trainable parameter of the model")
            torch.autograd.backward(loss.reshape(()) * cotangent, inputs=binding.leaves, retain_graph=retain_graph)
        finally:
            binding.end_micro()
            self._restore_buffers()
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._phase = "backward"
        self._lap("backward", start)
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End the micro-batch; at the accumulation boundary apply the update (or skip it on overflow)."""
        if lr_kwargs:
            raise ValueError("lr_kwargs is not supported: dsfunc's lr schedule is a function of the step count")
        if self._phase != "backward":
            raise RuntimeError(
                "engine.step() before engine.backward() for this micro-batch: call engine(inputs), "
                "engine.backward(loss), engine.step() for every micro-batch"
            )
        start = self._clock()
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._phase = "idle"
        if not boundary:
            self._lap("step", start)
            return
        state = self._state
        grads = self._binding.finish()
        loss = self._loss_sum / self.gradient_accumulation_steps()
        self._binding, self._loss_sum = None, None
        new = apply_gradients(state, grads, loss)
        state.mark_donated()
        self._state = new
        self.global_samples += self.train_batch_size()
        self._lap("step", start)
        self.monitor.log(new, samples=self.global_samples, tokens=self._tokens * self.world_size,
                         timings=self._timings or None)
        self._timings, self._tokens = {}, 0

    def _evaluate(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._phase == "forward":
            raise RuntimeError(
                "an evaluation forward (torch.no_grad() or engine.eval()) while a training forward waits for "
                "engine.backward(); finish that micro-batch first"
            )
        state = self._state
        program = state.program
        inputs, kwargs = program.to_device((inputs, kwargs))
        binding = ShardedBinding(program, state.params)
        restore = program.bind_buffers(state.buffers)
        try:
            with torch.no_grad():
                binding.begin_micro(0, 1)
                with program.rng_scope(state, 0):
                    return program.skeleton(*inputs, **kwargs)
        finally:
            self._unbind(restore)

    def _unbind(self, restore_buffers: Callable[[], None] | None) -> None:
        """Undo a forward's binding on this rank only (no collective)."""
        program = self._state.program
        program.slots.restore()
        program.workspace.session = None
        for unit in program.plan.units:
            program.workspace.release(unit)
        if restore_buffers is not None:
            restore_buffers()

    def _abandon_step(self) -> None:
        """After a failed forward: drop this optimizer step's micro-batches and start it again."""
        self._unbind(self._restore_buffers)
        self._binding, self._loss_sum, self._phase = None, None, "idle"
        self.micro_steps -= self.micro_steps % self.gradient_accumulation_steps()
        logger.warning("the forward failed; the micro-batches of this optimizer step were dropped")

    def _clock(self) -> float | None:
        if not self.config.wall_clock_breakdown:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _lap(self, name: str, start: float | None) -> None:
        if start is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._timings[name] = self._timings.get(name, 0.0) + (time.perf_counter() - start) * 1000

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        client_sd: dict[str, Any] | None = None,
    ) -> bool:
        """Save the training state to ``save_dir/<tag>`` (default tag ``global_step<N>``); every rank calls it.

        ``client_state`` (or ``client_sd``, the getting-started tutorial's name) comes back from
        :meth:`load_checkpoint`. Must be called at an accumulation boundary (after ``engine.step()``).
        """
        if client_state is not None and client_sd is not None:
            raise ValueError("pass the client state once: client_state= or client_sd=, not both")
        if exclude_frozen_parameters:
            raise ValueError("exclude_frozen_parameters=True is not supported: dsfunc checkpoints keep frozen "
                             "parameters with the buffers")
        client = dict(client_state if client_state is not None else client_sd or {})
        if ENGINE_KEY in client:
            raise ValueError(f"client_state key {ENGINE_KEY!r} is reserved for the engine's counters; rename it")
        if self._phase != "idle" or self._binding is not None:
            raise RuntimeError(
                f"save_checkpoint in the middle of an optimizer step (micro-batch "
                f"{self.micro_steps % self.gradient_accumulation_steps() + 1} of "
                f"{self.gradient_accumulation_steps()}): its gradients would be lost; save after the "
                "engine.step() that ends the step"
            )
        client[ENGINE_KEY] = {"global_samples": self.global_samples, "skipped_steps": self.skipped_steps}
        self.monitor.flush()
        checkpoint.save_checkpoint(self._state, save_dir, tag=tag, client_state=client, save_latest=save_latest)
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/<tag>`` (default: the tag in ``load_dir/latest``) into the engine.

        Returns ``(load_path, client_state)``, or ``(None, None)`` (with a warning) when there is nothing
        to load. ``load_module_only`` loads parameters and buffers only; ``load_optimizer_states=False``
        keeps fresh optimizer and loss-scaler state, ``load_lr_scheduler_states=False`` a fresh schedule.
        The engine's counters and its ``training_dataloader`` continue from the saved step.
        """
        if not load_module_strict:
            raise ValueError("load_module_strict=False is not supported: a checkpoint must match the model")
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported by dsfunc")
        if self._phase != "idle" or self._binding is not None:
            raise RuntimeError("load_checkpoint in the middle of an optimizer step; call it between steps")
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                logger.warning("Unable to find latest file at %s, if trying to load latest checkpoint please "
                               "ensure this file exists or pass an explicit checkpoint tag when loading a "
                               "checkpoint.", latest)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, str(tag))
        if not os.path.isdir(path):
            logger.warning("Client provided checkpoint load path: %s does not exist ... skip checkpoint load", path)
            return None, None
        loaded, client = _load_parts(load_dir, self._state, str(tag), load_module_only, load_optimizer_states,
                                     load_lr_scheduler_states)
        client = dict(client or {})
        counters = client.pop(ENGINE_KEY, None)
        self._state = loaded
        self._module_step = None
        if not load_module_only:
            step = int(loaded.step)
            self.micro_steps = step * self.gradient_accumulation_steps()
            counters = counters or {}
            self.global_samples = counters.get("global_samples", step * self.train_batch_size())
            self.monitor.restart(loaded, skipped_steps=counters.get("skipped_steps", 0))
            if self.training_dataloader is not None:
                self.training_dataloader.skip_to(self.micro_steps)
        return path, client


def _load_parts(load_dir: Any, current: TrainState, tag: str, module_only: bool, optimizer_states: bool,
                scheduler_states: bool) -> tuple[TrainState, Any]:
    """Load a checkpoint into ``current`` (donated), keeping ``current``'s values for the parts not asked for:
    everything but parameters and buffers (``module_only``), the optimizer state and loss scaler, the lr
    schedule (its step count, inside the optimizer state)."""
    def clone(tree: Any) -> Any:
        return optree.tree_map(lambda t: t.clone(), tree)

    kept = clone((current.step, current.scaler, current.rng, current.metrics))
    mixed = not module_only and optimizer_states != scheduler_states
    fresh_opt = clone(current.opt_state) if mixed else None
    with_opt = not module_only and (optimizer_states or scheduler_states)
    loaded, client = checkpoint.load_checkpoint(load_dir, current, tag=tag, load_optimizer_states=with_opt)
    step, scaler, rng, metrics = kept
    if module_only:
        return loaded.replace(step=step, scaler=scaler, rng=rng, metrics=metrics), client
    if not optimizer_states:
        loaded = loaded.replace(scaler=scaler)
    if mixed:
        def pick(fresh: Any, restored: Any) -> Any:
            wanted = scheduler_states if isinstance(fresh, ScheduleState) else optimizer_states
            return restored if wanted else fresh

        opt_state = optree.tree_map(pick, fresh_opt, loaded.opt_state, is_leaf=lambda x: isinstance(x, ScheduleState))
        loaded = loaded.replace(opt_state=opt_state)
    return loaded, client


def _schedule_count(opt_state: Any) -> torch.Tensor:
    """Applied steps so far, from the learning-rate state of the update."""
    for node in optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleState)):
        if isinstance(node, ScheduleState):
            return node.count
    raise ValueError("the optimizer state holds no learning-rate state")


class EngineOptimizer:
    """What :func:`initialize` returns as ``optimizer``: a view of the engine's update.

    ``param_groups[0]`` has the config's hyper-parameters with the current ``lr``; ``zero_grad()`` does
    nothing; stepping or saving it is an error that points to the engine.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        cfg = self._engine.config.optimizer
        return [{**{k: _plain(v) for k, v in cfg.params.items()}, "lr": self._engine.get_lr()[0]}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients never live on the module's parameters."""

    def step(self, closure: Any = None) -> None:
        raise RuntimeError("call engine.step() (after engine.backward(loss)); it applies the update")

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the optimizer state is engine.state.opt_state; save it with engine.save_checkpoint")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("restore the optimizer state with engine.load_checkpoint")


class EngineLRScheduler:
    """What :func:`initialize` returns as ``lr_scheduler``: a view of the engine's lr schedule.

    The engine advances it in ``engine.step()`` (not on skipped steps); calling ``step()`` here is an error.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: applied optimizer steps - 1."""
        return int(_schedule_count(self._engine.state.opt_state)) - 1

    def get_lr(self) -> list[float]:
        """The lr the next optimizer step uses."""
        return self._engine.get_lr()

    def get_last_lr(self) -> list[float]:
        """The lr the last applied optimizer step used."""
        if self.last_batch_iteration < 0:
            raise RuntimeError("need to call step() first: no optimizer step has been applied yet")
        return [float(current_lr(self._engine.state.opt_state))]

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the engine advances the lr schedule in engine.step(); remove lr_scheduler.step()")

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}
