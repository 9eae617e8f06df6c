"""The static half of a training state, and ``init_state`` which builds both halves.

A :class:`Program` holds what never changes during a run and is never checkpointed as tensors: the
parsed config, the hook-free model skeleton (parameters on ``meta``), the sharding plan, the compute
workspace, the update transform, the loss scaler and the composed step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import nn

from dsfunc import kernels
from dsfunc.config import Config
from dsfunc.dist import comm
from dsfunc.fused import FusedAdam
from dsfunc.optim import (
    apply_updates,
    clip_by_global_norm,
    current_lr,
    named_chain,
    optimizer_from_config,
    scale_by_factor,
)
from dsfunc.scaling import LossScaler, check_not_dead
from dsfunc.schedules import momentum_schedule_from_config, schedule_from_config
from dsfunc.state import FrozenDict, Metrics, TrainState
from dsfunc.zero import (
    ShardingPlan,
    Workspace,
    _Slots,
    flatten_unit,
    install_hooks,
    local_shard,
    make_plan,
    segment_norm_fn,
    unit_views,
)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclasses.dataclass(eq=False)
class Program:
    """Everything static about a run (identity-compared, so states of one run share a treedef)."""

    config: Config
    plan: ShardingPlan
    skeleton: nn.Module
    slots: _Slots
    workspace: Workspace
    optimizer: Any
    scaler: LossScaler
    loss_fn: LossFn | None
    device: torch.device
    compute_dtype: torch.dtype
    comm_dtype: torch.dtype
    persistent_buffers: tuple[str, ...]
    step_fn: Callable[..., TrainState]
    segment_norm: Callable[[Any], Any] | None = None
    fused: FusedAdam | None = None
    _scaler_check: Any = None

    # -- pieces the step uses ----------------------------------------------------------------------
    def to_device(self, batch: Any) -> Any:
        return optree.tree_map(
            lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch
        )

    def bind_buffers(self, buffers: Mapping[str, torch.Tensor]) -> Callable[[], None]:
        """Bind buffers (cast to the compute dtype when floating); return a function that writes back."""
        written = []
        for name, t in buffers.items():
            bound = t
            if t.is_floating_point() and t.dtype != self.compute_dtype:
                bound = t.to(self.compute_dtype)
                written.append((t, bound))
            self.slots.bind_buffer(name, bound)

        def restore() -> None:
            with torch.no_grad():
                for t, bound in written:
                    t.copy_(bound)

        return restore

    @contextlib.contextmanager
    def rng_scope(self, state: TrainState, micro: int) -> Iterator[None]:
        """Seed dropout from (seed, step, micro-batch, rank) so a resumed run draws the same masks."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            seed = hash((int(state.rng[0]), int(state.step), micro, self.plan.rank)) & 0x7FFF_FFFF_FFFF
            torch.manual_seed(seed)
            yield

    def compute_loss(self, loss_fn: LossFn | None, batch: Any) -> torch.Tensor:
        model = self.skeleton
        if loss_fn is not None:
            out = loss_fn(model, batch)
        elif isinstance(batch, Mapping):
            out = model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = model(*batch)
        else:
            out = model(batch)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
            raise ValueError(
                f"the loss must be a scalar floating-point tensor, got {what}. Pass loss_fn=lambda model, "
                "batch: ... to dsfunc.init_state, or make the model return the loss (or an object with .loss)"
            )
        return loss.reshape(())

    def sum_of_squares(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return kernels.sum_of_squares(tensors)

    def apply_updates(self, params: Mapping[str, torch.Tensor], updates: Any) -> Any:
        return apply_updates(dict(params), updates)

    def current_lr(self, opt_state: Any) -> torch.Tensor:
        lr = current_lr(opt_state)
        return torch.zeros((), device=self.device) if lr is None else lr.detach().clone()

    def check_scaler(self, state: TrainState) -> None:
        """Raise if the previous step overflowed at the minimum loss scale (read without stalling CUDA)."""
        pending = self._scaler_check
        if pending is None:
            return
        flag, event = pending
        if event is not None and not event.query():
            return
        self._scaler_check = None
        if bool(flag):
            check_not_dead(self.scaler, state.scaler)

    def note_scaler(self, state: TrainState) -> None:
        if not (self.scaler.dynamic and self.scaler.raise_error_at_min_scale):
            return
        dead = state.scaler.dead
        if dead.device.type == "cuda":
            flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            flag.copy_(dead, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._scaler_check = (flag, event)
        else:
            self._scaler_check = (dead.clone(), None)


# --------------------------------------------------------------------------------------------------
# building a state


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


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_state(
    model: nn.Module,
    config: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: Any = None,
    seed: int = 0,
    unit_modules: Sequence[str] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
) -> TrainState:
    """Build the training state for ``model`` as the DeepSpeed ``config`` describes.

    Args:
      model: the ``nn.Module`` to train; it may live on the ``meta`` device, in which case each rank
        materialises only its own shard, one module at a time (with each module's
        ``reset_parameters()`` or ``param_init_fn(module)``), so no rank ever holds the whole model.
      config: a DeepSpeed config: dict, JSON path, ``argparse.Namespace`` with ``deepspeed_config``,
        or a :class:`dsfunc.Config`.
      loss_fn: ``loss_fn(model, batch) -> scalar``; without it the model's forward returns the loss.
      optimizer: an update transform replacing the config's optimizer section.
      seed: seeds dropout (and meta-device initialisation); the state carries it across resume.
      unit_modules: module paths to shard as units (default: blocks of the largest ModuleList).
      param_init_fn: initialises a module materialised from ``meta`` (in place).
      device: where the state lives (default: the current CUDA device, else the CPU).

    Returns:
      A :class:`TrainState`; every rank of the process group must call this.
    """
    cfg = Config.load(config, world_size=comm.world_size())
    device = torch.device(device) if device is not None else default_device()
    zero = cfg.zero_optimization
    plan = make_plan(model, stage=zero.stage, world_size=comm.world_size(), rank=comm.rank(),
                     unit_modules=unit_modules)
    skeleton = make_skeleton(model)
    compute_dtype = cfg.compute_dtype
    comm_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: torch.float32}[
        cfg.communication_data_type
    ]

    params, buffers = _materialize(model, skeleton, plan, device, seed, param_init_fn)
    scaler = LossScaler.from_config(cfg.fp16) if cfg.fp16.enabled else LossScaler.none()
    update, fused = (optimizer, None) if optimizer is not None else _optimizer_from(cfg)
    workspace = Workspace(
        plan, compute_dtype=compute_dtype, device=device,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        max_live_elements=zero.stage3_max_live_parameters,
        prefetch=zero.overlap_comm and zero.stage3_prefetch_bucket_size > 0,
    )
    install_hooks(skeleton, workspace)
    _install_input_cast(skeleton, workspace, compute_dtype)
    from dsfunc.step import make_train_step  # the step module imports this one's types

    program = Program(
        config=cfg, plan=plan, skeleton=skeleton, slots=_Slots(skeleton, plan, buffers.keys()),
        workspace=workspace, optimizer=update, scaler=scaler, loss_fn=loss_fn, device=device,
        compute_dtype=compute_dtype, comm_dtype=comm_dtype,
        persistent_buffers=tuple(k for k in model.state_dict() if k in buffers),
        step_fn=make_train_step(), segment_norm=segment_norm_fn(plan, device), fused=fused,
    )
    zero_scalar = torch.zeros((), device=device)
    state = TrainState(
        step=torch.zeros((), dtype=torch.int64),
        params=FrozenDict(params),
        opt_state=update.init(dict(params)),
        scaler=scaler.init(device),
        buffers=FrozenDict(buffers),
        rng=torch.tensor([seed], dtype=torch.int64),
        metrics=Metrics(loss=zero_scalar.clone(), grad_norm=zero_scalar.clone(),
                        loss_scale=scaler.init(device).scale.clone(), lr=zero_scalar.clone(),
                        skipped=torch.zeros((), dtype=torch.int32, device=device)),
        program=program,
    )
    workspace.refresh(state.params)
    return state


def _optimizer_from(cfg: Config) -> tuple[Any, FusedAdam | None]:
    if cfg.optimizer is None:
        raise ValueError(
            'the config has no "optimizer" section; add one, e.g. '
            '"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, or pass optimizer=... to init_state'
        )
    base_lr = cfg.optimizer.params["lr"]
    schedule = momentum = None
    if cfg.scheduler is not None:
        schedule = schedule_from_config(cfg.scheduler.type, cfg.scheduler.params, base_lr)
        momentum = momentum_schedule_from_config(cfg.scheduler.type, cfg.scheduler.params)
    optimizer = optimizer_from_config(cfg.optimizer.type, cfg.optimizer.params, schedule,
                                      momentum_schedule=momentum)
    chain = named_chain(
        ("unscale", scale_by_factor("grad_scale")),
        ("clip", clip_by_global_norm(cfg.gradient_clipping)),
        ("optimizer", optimizer),
    )
    return chain, FusedAdam.from_config(cfg, schedule, momentum)


def _install_input_cast(skeleton: nn.Module, workspace: Workspace, dtype: torch.dtype) -> None:
    """Cast floating-point inputs of the model's forward to the compute dtype (as FSDP2 does)."""
    if dtype == torch.float32:
        return

    def cast(module: nn.Module, args: Any, kwargs: Any) -> Any:
        if workspace.session is None:
            return None
        f = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        return optree.tree_map(f, args), optree.tree_map(f, kwargs)

    skeleton.register_forward_pre_hook(cast, with_kwargs=True)


@dataclasses.dataclass
class InitStats:
    """How many parameter elements existed at once while materialising from ``meta``."""

    max_elements: int = 0


INIT_STATS = InitStats()


@torch.no_grad()
def _materialize(
    model: nn.Module, skeleton: nn.Module, plan: ShardingPlan, device: torch.device, seed: int,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's fp32 master shards (by unit) and its buffers (and frozen parameters) by name."""
    on_meta = any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())
    source = _MetaSource(skeleton, device, seed, param_init_fn) if on_meta else None
    tensors = dict(model.named_parameters(remove_duplicate=False))
    params = {}
    for unit in plan.units:
        if source is not None:
            values = source.unit_tensors([slot.name for slot in unit.params])
        else:
            values = {slot.name: tensors[slot.name].detach() for slot in unit.params}
        values = {k: v.to(device=device, dtype=torch.float32) for k, v in values.items()}
        flat = flatten_unit(unit, values, plan.padded_size(unit))
        INIT_STATS.max_elements = max(INIT_STATS.max_elements, flat.numel())
        params[unit.name] = flat if plan.ways == 1 else local_shard(plan, unit, flat)
        del flat, values
    named_buffers = dict(model.named_buffers())
    extra = {name: named_buffers[name] for name in named_buffers}
    extra.update({name: tensors[name] for name in plan.frozen})
    if source is not None:
        extra = source.unit_tensors(list(extra), buffers=True)
    buffers = {k: v.detach().to(device).clone() for k, v in extra.items()}
    return params, buffers


class _MetaSource:
    """Materialises parameters of a ``meta`` model one owning module at a time, identically on every rank."""

    def __init__(self, skeleton: nn.Module, device: torch.device, seed: int,
                 init_fn: Callable[[nn.Module], None] | None) -> None:
        self.skeleton, self.device, self.seed, self.init_fn = skeleton, device, seed, init_fn
        self.order = {name: i for i, (name, _) in enumerate(skeleton.named_modules())}

    def unit_tensors(self, names: Sequence[str], buffers: bool = False) -> dict[str, torch.Tensor]:
        by_module: dict[str, list[str]] = {}
        for name in names:
            path, _, attr = name.rpartition(".")
            by_module.setdefault(path, []).append(attr)
        out = {}
        for path, attrs in by_module.items():
            made = self._materialize_module(path)
            for attr in attrs:
                out[f"{path}.{attr}" if path else attr] = made[attr]
        return out

    def _materialize_module(self, path: str) -> dict[str, torch.Tensor]:
        module = self.skeleton.get_submodule(path) if path else self.skeleton
        alone = copy.copy(module)  # shallow: own parameters and buffers only, no children
        alone._modules = {}
        alone._parameters = {k: nn.Parameter(torch.empty_like(v, device=self.device), v.requires_grad)
                             for k, v in module._parameters.items() if v is not None}
        alone._buffers = {k: torch.empty_like(v, device=self.device)
                          for k, v in module._buffers.items() if v is not None}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed * 1_000_003 + self.order[path])
            with torch.no_grad():
                if self.init_fn is not None:
                    self.init_fn(alone)
                elif hasattr(alone, "reset_parameters"):
                    alone.reset_parameters()
                elif alone._parameters or alone._buffers:
                    raise ValueError(
                        f"the model is on the meta device and module {path or '<root>'!r} "
                        f"({type(module).__name__}) owns parameters or buffers but has no reset_parameters(); "
                        "pass param_init_fn=fn to dsfunc.init_state, where fn(module) fills them in place"
                    )
        return {**alone._parameters, **alone._buffers}


# --------------------------------------------------------------------------------------------------
# reading a state


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
