"""Building a training state (:func:`init_state`) and reading its weights back (:func:`full_params`).

A state has two halves: the data half is the :class:`~dsfunc.TrainState`'s leaves, the static half its
:class:`~dsfunc.program.Program`, which this module builds.

The skeleton is a hook-free copy of the user's module by default: the functional API leaves the module
it was given alone (``model.load_state_dict(dsfunc.full_params(state))`` brings the weights back).
With ``in_place=True`` — what the DeepSpeed engine passes, since in DeepSpeed the model passed in *is*
the engine's module — the skeleton is the module itself: its parameters become resident views of the
state's compute copies (:mod:`dsfunc.zero.binding`), so it holds the trained values after every step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dsfunc.batch import LossFn
from dsfunc.compile import compile_forwards
from dsfunc.config import (
    ActivationCheckpointingConfig,
    CompileConfig,
    Config,
    PipelineConfig,
    announce_without_effect,
    parse_activation_checkpointing,
    parse_compile,
)
from dsfunc.config.dtypes import DTYPES
from dsfunc.config.leaf_modules import LeafModules
from dsfunc.distributed import comm
from dsfunc.distributed.env import rank_variable
from dsfunc.distributed.mesh import Mesh, run_mesh
from dsfunc.distributed.process_group import join_launched_world
from dsfunc.errors import InputError, NotSupportedError
from dsfunc.experts.autoep import apply_autoep, check_expert_mesh, expert_units
from dsfunc.experts.ep_block import ExpertParallelBlock
from dsfunc.experts.layer import MoE, bind_experts
from dsfunc.experts.placement import expert_split, whole_values
from dsfunc.frozen import FrozenDict
from dsfunc.graphs import GraphedStep
from dsfunc.launcher.cores import THREADS_VARIABLE, busy_cores, threads_per_rank
from dsfunc.optim.base import Transform, multi_transform
from dsfunc.optim.from_config import LrSchedule, lr_schedule_of, update_from_config
from dsfunc.optim.fused import FusedAdam
from dsfunc.optim.groups import ParamGroups
from dsfunc.optim.muon import muon_groups
from dsfunc.optim.torch_optimizer import TorchOptimizerUpdate
from dsfunc.optim.update import ChainUpdate
from dsfunc.parallel.hf_attention import sequence_parallel
from dsfunc.pipeline.pipelined import Pipeline
from dsfunc.pipeline.place import place
from dsfunc.pipeline.stage import StageModule
from dsfunc.program import Program
from dsfunc.remat import checkpoint_units
from dsfunc.run import RunContext
from dsfunc.scaling import LossScaler
from dsfunc.state import Metrics, TrainState
from dsfunc.step import check_min_scale, make_train_step, note_min_scale
from dsfunc.zero.binding import Binding
from dsfunc.zero.gather import Workspace
from dsfunc.zero.hooks import install_input_cast, install_unit_hooks
from dsfunc.zero.layout import ShardingPlan, make_plan, unit_views
from dsfunc.zero.leaf import (
    mark_leaf_parameters,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
)
from dsfunc.zero.materialize import materialize
from dsfunc.zero.matrices import matrix_shards
from dsfunc.zero.norms import segment_norm_fn
from dsfunc.zero.offload import placement as placement_from_config
from dsfunc.zero.placeholders import full_shape
from dsfunc.zero.reduce import grad_dtype, sum_dtype

if TYPE_CHECKING:
    from dsfunc.parallel.autotp import Plan
    from dsfunc.parallel.tensor import TensorParallel

logger = logging.getLogger("dsfunc")



def init_state(
    model: nn.Module,
    config: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: Transform | ChainUpdate | FusedAdam | torch.optim.Optimizer | None = None,
    seed: int = 0,
    unit_modules: Sequence[str] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    compile: bool | Mapping[str, Any] | None = None,
    activation_checkpointing: str | Mapping[str, Any] | None = None,
    in_place: bool = False,
    param_groups: ParamGroups | None = None,
    lr_schedule: LrSchedule | None = None,
    pipeline: int | Mapping[str, Any] | PipelineConfig | None = None,
    mesh: Mesh | DeviceMesh | None = None,
    tp_plan: Plan | None = None,
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
        (optax's ``multi_transform``). A transform's learning rate is its own (a float or a schedule such
        as ``dsfunc.adamw(lr=dsfunc.warmup_lr(...))``), so a config ``scheduler`` beside it is an error.
        Or any ``torch.optim.Optimizer`` (built on the model's parameters; with ``param_groups`` labelled
        ``group0``, ``group1``, ... its groups in order): its ``step()`` runs on the fp32 shards
        (:mod:`dsfunc.optim.torch_optimizer`), its lr scheduled by ``lr_schedule`` or the config's scheduler.
      seed: seeds dropout (and meta-device initialisation); the state carries it across resume.
      unit_modules: module paths to shard as units (default: blocks of the largest ModuleList).
      param_init_fn: initialises a module materialised from ``meta`` (in place).
      device: where the state lives (default: the current CUDA device, else the CPU).
      compile: compile each unit's forward, or the whole model's (``"scope": "model"``), with ``torch.compile``
        (:mod:`dsfunc.compile`): ``True``, or a ``compile`` config section (``{"backend": ..., "scope": ...,
        "kwargs": {...}}``); default: the config's section.
      activation_checkpointing: which units recompute their forward in backward (:mod:`dsfunc.remat`):
        a policy (``"units"``, ``"selective"``, ``"none"``) or an ``activation_checkpointing`` config section
        (``{"policy": "units", "every": 2}``); default: the config's section.
      in_place: train ``model`` itself instead of a copy. Its parameters become views of the state's
        compute copies on ``device`` (in the compute dtype; at ZeRO-3 empty outside a forward, as in
        DeepSpeed: a forward through ``model`` gathers what it runs), its buffers the state's own, so
        ``model`` holds the current weights after every step with no copy. Parameter objects keep
        their identity unless they were on ``meta``.
      param_groups: optimizer options per group of parameters, the groups named by a label function
        over parameter names (:class:`dsfunc.ParamGroups`), e.g. no weight decay on biases and norms.
      lr_schedule: ``lr_schedule(group_lr) -> Schedule`` replaces the config's scheduler section, once
        per parameter group.
      pipeline: pipeline parallelism (:mod:`dsfunc.pipeline`): the stages, or a ``pipeline`` config section
        (``{"stages": 2, "schedule": "1F1B"}``); default: the config's section. ``model`` is then a layer list
        (``nn.Sequential``, or modules, ``LayerSpec``/``TiedLayerSpec`` and callables) or a ``PipelineModule``;
        each rank builds and trains its own stage (its layers split over the stage's tp ranks with
        ``tensor_parallel.autotp_size``: a ``pp x dp x tp`` mesh), ZeRO runs over the stage's data-parallel ranks
        (``world_size / (stages x tp)``, which the config's batch sizes count), ``loss_fn(outputs, labels)`` runs on
        the last stage, and a step's batch is ``(inputs, labels)``.
      mesh: the ranks' named axes (:mod:`dsfunc.distributed.mesh`): a torch ``DeviceMesh`` with dimensions among
        ``pp``, ``dp``, ``sp``, ``tp`` (or a :class:`~dsfunc.distributed.mesh.Mesh`); default: the one the
        config describes (``tensor_parallel.autotp_size``, ``sequence_parallel_size``, the rest ``dp``). ZeRO
        shards over ``dp x sp``; the config's batch sizes count ``dp``; each rank's step gets its ``dp`` slice.
      tp_plan: module path pattern (``*``: one path component) -> ``"colwise"``/``"rowwise"`` or a torch
        ``ParallelStyle``, replacing the config's and the model's own tp plan (:mod:`dsfunc.parallel.autotp`).

    Returns:
      A :class:`TrainState`; every rank of the process group must call this. A process that a launcher
      started (the dsfunc launcher, torchrun, mpirun: ``WORLD_SIZE`` or MPI's variables are set) joins the
      world they describe first, unless a process group exists; a group of another size is refused.
      Unless ``in_place``, ``model`` itself is only read: the state trains a skeleton copy of it.
    """
    join_launched_world()  # the ranks a launcher started train one model, as deepspeed.initialize's do
    _fit_threads_to_host()
    placement = place(model, config, pipeline, loss_fn, mesh, _default_device(device).type)
    if placement is not None:
        return _build(placement.module, config, None, optimizer=optimizer, seed=seed,
                      unit_modules=placement.module.unit_modules() if unit_modules is None else unit_modules,
                      param_init_fn=param_init_fn, device=device, compile=compile,
                      activation_checkpointing=activation_checkpointing, in_place=in_place,
                      param_groups=param_groups, lr_schedule=lr_schedule, pipeline=placement.pipeline,
                      mesh=placement.mesh, tp_plan=tp_plan)
    if unit_modules is None and isinstance(model, StageModule):  # a layer list's units are its layers
        unit_modules = model.unit_modules()
    return _build(model, config, loss_fn, optimizer=optimizer, seed=seed, unit_modules=unit_modules,
                  param_init_fn=param_init_fn, device=device, compile=compile,
                  activation_checkpointing=activation_checkpointing, in_place=in_place, param_groups=param_groups,
                  lr_schedule=lr_schedule, pipeline=None, mesh=run_mesh(config, mesh, _default_device(device)),
                  tp_plan=tp_plan)


def _mark_leaves(model: nn.Module, leaves: LeafModules) -> None:
    """Mark the modules ``zero_optimization.leaf_module`` names as leaves (those not in the model are no error,
    as in DeepSpeed: its defaults name Hugging Face's MoE blocks)."""
    if leaves.classes:
        set_z3_leaf_modules(model, list(leaves.classes), raise_if_not_found=False)
    if leaves.names:
        set_z3_leaf_modules_by_name(model, list(leaves.names), raise_if_not_found=False)
    if leaves.name_suffixes:
        set_z3_leaf_modules_by_suffix(model, list(leaves.name_suffixes), raise_if_not_found=False)


def _build(model: nn.Module, config: Any, loss_fn: LossFn | None, *, optimizer: Any, seed: int,
           unit_modules: Sequence[str] | None, param_init_fn: Callable[[nn.Module], None] | None,
           device: torch.device | str | None, compile: bool | Mapping[str, Any] | None,
           activation_checkpointing: str | Mapping[str, Any] | None, in_place: bool,
           param_groups: ParamGroups | None, lr_schedule: LrSchedule | None, pipeline: Pipeline | None,
           mesh: Mesh, tp_plan: Plan | None = None) -> TrainState:
    """:func:`init_state` for one module (a pipeline stage's, its ZeRO over the stage's data-parallel ranks)."""
    cfg = Config.load(config, world_size=mesh.batch_ranks)
    announce_without_effect(cfg)
    device = _default_device(device)
    zero = cfg.zero_optimization
    check_expert_mesh(model, cfg.expert_parallel, mesh)
    # the user's model, as DeepSpeed's initialize replaces its blocks; a tp group's ranks share their tokens out
    apply_autoep(model, cfg.expert_parallel, mesh.group("tp"))
    _mark_leaves(model, zero.leaf_module)
    muon = optimizer is None and cfg.optimizer is not None and cfg.optimizer.type == "muon"
    if muon:  # DeepSpeed splits every group into a Muon half and an Adam half: so do the units
        shapes = {n: tuple(full_shape(p)) for n, p in model.named_parameters() if p.requires_grad}
        param_groups = muon_groups(shapes, cfg.optimizer.params, param_groups)
    if pipeline is not None and any(isinstance(m, (MoE, ExpertParallelBlock)) for m in model.modules()):
        raise NotSupportedError("MoE layers with expert parallelism inside a pipeline stage are not supported by "
                                "dsfunc yet: train the MoE model without a pipeline")
    bind_experts(model)  # before the skeleton is copied from the model: the copy keeps the MoE layers' groups
    if zero.stage == 3:
        mark_leaf_parameters(model)
    skeleton = model if in_place else make_skeleton(model)
    tensor = _split(model, skeleton, cfg, mesh, tp_plan)
    if mesh.size("sp") > 1:  # Ulysses over each tp rank's heads: attention routed, the loss over the split sequence
        loss_fn = sequence_parallel(skeleton, loss_fn, mesh.group("sp"), mesh.size("tp"),
                                    whole=mesh.sp_summed(zero.stage) == 1)
    # a split model's units hold each rank's tp parts: the skeleton's (local) shapes
    plan, groups = _plan(model if tensor is None else skeleton, zero.stage, unit_modules, param_groups, mesh.zero)
    if tensor is not None:
        _check_experts_whole(skeleton, tensor)
        plan = dataclasses.replace(plan, tp=tensor.group, split=frozenset(tensor.split))
    comm_dtype = DTYPES[cfg.communication_data_type or "fp32"]
    gas = cfg.gradient_accumulation_steps
    # DeepSpeed's bf16 masters: the fp32 values rounded to nearest
    masters = torch.bfloat16 if cfg.bf16.bf16_master_weights_and_grads else torch.float32
    placement = placement_from_config(plan, zero, compute_device=device, compute_dtype=cfg.compute_dtype,
                                      grad_dtype=grad_dtype(cfg.compute_dtype, comm_dtype, plan.world_size, gas,
                                                            sum_dtype(cfg)),
                                      micro_batches=gas, master_dtype=masters)
    if pipeline is not None and placement.masters is not None:
        raise NotSupportedError("ZeRO-Offload with pipeline parallelism is not supported by dsfunc; remove the "
                                "offload_optimizer/offload_param sections or the pipeline")
    params, buffers = materialize(model, skeleton, plan, device, seed, param_init_fn, placement,
                                  local=None if tensor is None else _tp_local(tensor, plan))
    if tensor is not None:
        tensor.sync(buffers)
    if cfg.buffer_dtype is not None:  # data_types.buffer_dtype: the floating buffers cast (not frozen parameters)
        names = {name for name, _ in model.named_buffers()}
        buffers = {k: v.to(DTYPES[cfg.buffer_dtype]) if k in names and v.is_floating_point() else v
                   for k, v in buffers.items()}
    if masters != torch.float32:
        params = {name: p.to(masters) for name, p in params.items()}
    binding = Binding(skeleton, plan, buffers.keys())
    scaler = LossScaler.from_config(cfg.fp16)
    update = _update(cfg, plan, optimizer, param_groups, groups, lr_schedule,
                     matrix_shards(plan, device) if muon else None)
    workspace = Workspace(
        plan, binding=binding, compute_dtype=cfg.compute_dtype, device=device,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        max_live_elements=zero.stage3_max_live_parameters,
        prefetch=zero.overlap_comm and zero.stage3_prefetch_bucket_size > 0, source=placement.shards,
    )
    run = RunContext.build(workspace, placement, pipeline)
    compile_options = _compile_options(cfg, compile)
    _prepare_skeleton(skeleton, run, cfg, _remat_options(cfg, activation_checkpointing), compile_options)
    program = Program(
        config=cfg, plan=plan, skeleton=skeleton, binding=binding,
        run=run, update=update, scaler=scaler, loss_fn=loss_fn, device=device,
        compute_dtype=cfg.compute_dtype, comm_dtype=comm_dtype,
        persistent_buffers=tuple(k for k in model.state_dict() if k in buffers),
        step_fn=_step_fn(compile_options, pipeline), segment_norm=segment_norm_fn(plan, device),
        mesh=mesh, tensor=tensor,
    )
    state = _first_state(program, params, buffers, seed)
    workspace.refresh(state.params)
    binding.restore(state.buffers)
    return state


def _split(model: nn.Module, skeleton: nn.Module, cfg: Config, mesh: Mesh,
           tp_plan: Plan | None) -> TensorParallel | None:
    """Split the skeleton over the mesh's tp axis (:mod:`dsfunc.parallel.tensor`, imported with DTensor only
    then); None at tp 1."""
    if mesh.size("tp") == 1 and tp_plan is None:
        return None
    from dsfunc.parallel.tensor import check_tensor_parallel, tensor_parallel

    check_tensor_parallel(model)
    return tensor_parallel(skeleton, mesh, cfg.tensor_parallel, tp_plan)


def _check_experts_whole(skeleton: nn.Module, tensor: TensorParallel) -> None:
    """AutoEP's routers and experts stay whole over tp (each tp rank routes its share of the tokens through them:
    [Note: experts under tensor parallelism]), so checkpoints and full weights take an expert's ep slice alone."""
    blocks = [f"{path}." for path, m in skeleton.named_modules() if isinstance(m, ExpertParallelBlock)]
    split = sorted(n for n in tensor.split for b in blocks if n.startswith((f"{b}gate.", f"{b}experts.")))
    if split:
        raise NotSupportedError(
            f"the tp plan splits {', '.join(split[:2])}{' ...' if len(split) > 2 else ''} over the tp ranks, but "
            "AutoEP's routers and experts stay whole on each tp rank (the experts are split over "
            "expert_parallel.autoep_size instead): leave the MoE blocks' gate and experts out of the tp plan")


def _tp_local(tensor: TensorParallel, plan: ShardingPlan) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Each parameter's tp part (tp rank 0's value, split), but an expert's, which is this rank's own slice of the
    experts (its place in the expert-parallel group, whatever its tp rank)."""
    own = {slot.name for unit in plan.units if unit.group is not None for slot in unit.params}
    return lambda name, value: value if name in own else tensor.local_value(name, value)


def _first_state(program: Program, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 seed: int) -> TrainState:
    """Step 0: fresh optimizer and loss-scaler states, zero metrics."""
    scaler_state = program.scaler.init(program.device)
    return TrainState(
        step=torch.zeros((), dtype=torch.int64),
        params=FrozenDict(params),
        opt_state=program.update.init(params),
        scaler=scaler_state,
        buffers=FrozenDict(buffers),
        rng=torch.tensor([seed], dtype=torch.int64),
        metrics=Metrics.before_training(scaler_state.scale),
        program=program,
    )


def _plan(model: nn.Module, stage: int, unit_modules: Sequence[str] | None, param_groups: ParamGroups | None,
          group: comm.Group) -> tuple[ShardingPlan, list[str]]:
    """The sharding plan, with units split by parameter group when there are several groups and each MoE layer's
    experts a unit reduced over their expert-data-parallel ranks, and the groups in order."""
    groups = param_groups.order(n for n, p in model.named_parameters() if p.requires_grad) if param_groups else []
    found = bind_experts(model) | expert_units(model)
    experts = {path: None if g.data is None else comm.Group.of(g.data) for path, g in found.items()}
    plan = make_plan(model, stage=stage, group=group, unit_modules=unit_modules,
                     labels=param_groups.label_of if len(groups) > 1 else None, own_groups=experts)
    return plan, groups


def _prepare_skeleton(skeleton: nn.Module, run: RunContext, cfg: Config,
                      remat: ActivationCheckpointingConfig, compile: CompileConfig) -> None:
    """Hooks (stage-3 gathers, input cast), then checkpointing of the unit forwards, then compilation.

    A module trained in place before first drops what that state installed, which this one replaces.
    """
    for handle in getattr(skeleton, "_dsfunc_hooks", ()):
        handle.remove()
    _restore_forwards(skeleton)
    workspace = run.workspace
    joint = run.grads.micro_batches_per_backward > 1
    skeleton._dsfunc_hooks = (install_unit_hooks(skeleton, workspace, every=joint)
                              + install_input_cast(skeleton, workspace, cfg.compute_dtype))
    for unit in workspace.plan.units:
        if unit.module is not None:
            module = skeleton.get_submodule(unit.module)
            module._dsfunc_own_forward = module.__dict__.get("forward")
    if compile.scope == "units" and remat.host_work():
        # the checkpoint's host work (a host copy, a sync, a clock) around each compiled unit, not inside its
        # graph: there dynamo would give up on the unit and run it eagerly, silently
        compile_forwards(skeleton, workspace.plan, compile, remat)
        checkpoint_units(skeleton, workspace.plan, remat)
    else:
        checkpoint_units(skeleton, workspace.plan, remat)
        compile_forwards(skeleton, workspace.plan, compile, remat)


def _restore_forwards(skeleton: nn.Module) -> None:
    """Undo the forward wrappers (checkpointing, compilation) a previous state put on these modules."""
    for module in skeleton.modules():
        if "_dsfunc_own_forward" not in module.__dict__:
            continue
        own = module.__dict__.pop("_dsfunc_own_forward")
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = own


def _update(cfg: Config, plan: ShardingPlan, optimizer: Any, param_groups: ParamGroups | None, groups: list[str],
            lr_schedule: LrSchedule | None, matrices: Any = None) -> ChainUpdate | FusedAdam | TorchOptimizerUpdate:
    """The update the program applies: the config's (per parameter group), or the one given. ``matrices``: the
    units' matrix layout, for a config's Muon."""
    unit_groups = {u.name: u.label for u in plan.units}
    if optimizer is None:
        options = None
        if groups:
            opts = param_groups.options
            options = {None: opts.get(groups[0], {})} if len(groups) == 1 else {g: opts.get(g, {}) for g in groups}
        return update_from_config(cfg, lr_schedule, group_options=options, unit_groups=unit_groups,
                                  matrices=matrices)
    if isinstance(optimizer, torch.optim.Optimizer):
        return _torch_update(cfg, plan, optimizer, groups, lr_schedule)
    if param_groups is not None and param_groups.options or lr_schedule is not None:
        raise InputError(
            "param_groups options and lr_schedule configure the config's optimizer; with optimizer= give "
            "each group its own transform instead: optimizer={label: transform, ...}"
        )
    if isinstance(optimizer, (ChainUpdate, FusedAdam)):
        return optimizer
    _check_no_scheduler(cfg)
    if isinstance(optimizer, Mapping):
        missing = sorted(set(groups) - set(optimizer))
        if param_groups is None or missing:
            raise InputError(f"optimizer={{label: transform}} needs param_groups= naming the groups and a "
                             f"transform for each of them (missing: {missing})")
        transform = optimizer[groups[0]] if len(groups) == 1 else multi_transform(dict(optimizer), unit_groups)
        return ChainUpdate(transform)
    return ChainUpdate(optimizer)


def _torch_update(cfg: Config, plan: ShardingPlan, optimizer: torch.optim.Optimizer, groups: list[str],
                  lr_schedule: LrSchedule | None) -> TorchOptimizerUpdate:
    """A client torch optimizer as the update: parameter group ``i`` is label ``group{i}`` (the only group: no
    label), its lr scheduled by ``lr_schedule`` or the config's ``scheduler`` section."""
    count = len(optimizer.param_groups)
    if count > 1 and groups != [f"group{i}" for i in range(count)]:
        raise InputError(f"a torch optimizer with {count} param_groups needs param_groups labelled group0..group"
                         f"{count - 1} (deepspeed.initialize(optimizer=...) labels them)")
    index = {None: 0} if count == 1 else {f"group{i}": i for i in range(count)}
    schedule_for = lr_schedule if lr_schedule is not None else (lambda lr: lr_schedule_of(cfg, lr))
    schedules = tuple(schedule_for(float(g.get("initial_lr", g["lr"]))) for g in optimizer.param_groups)
    return TorchOptimizerUpdate(optimizer, {u.name: index[u.label if count > 1 else None] for u in plan.units},
                                schedules, clip_norm=cfg.gradient_clipping)


def _check_no_scheduler(cfg: Config) -> None:
    """An update transform brings its own learning rate: a config ``scheduler`` beside it would not apply."""
    if cfg.scheduler is not None:
        raise InputError(
            f'init_state got optimizer=<an update transform> and a config with a "scheduler" section '
            f"({cfg.scheduler.type}), which would not apply: the transform's own learning rate is used. Put the "
            "schedule into the transform, e.g. optimizer=dsfunc.adamw(lr=dsfunc.warmup_lr(warmup_max_lr=1e-3, "
            'warmup_num_steps=100)), or remove the config\'s "scheduler" section (or set it to null).'
        )


def make_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta`` and with no user hooks."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(full_shape(p), dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
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
    program = state.program
    program.run.wait()  # the masters are final
    if program.run.pipeline is None:
        return _full_params(state)
    return program.run.pipeline.gather_stages(_full_params(state))


def _full_params(state: TrainState) -> dict[str, torch.Tensor]:
    """:func:`full_params` of one module (a pipeline stage's)."""
    program = state.program
    plan = program.plan
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list[str]] = {}  # an expert unit's first local name: the names of every ep rank's experts
    for unit in plan.units:
        shard = state.params[unit.name].to(program.device)  # an offloaded master is gathered on the device
        flat = torch.empty(plan.padded_size(unit), dtype=shard.dtype, device=shard.device)  # bf16 masters: bf16
        comm.all_gather_flat(flat, shard, plan.group_of(unit)) if plan.ways > 1 else flat.copy_(shard)
        split = expert_split(program.skeleton, unit)
        if program.tensor is not None and split is None:
            values = [(slot.aliases, program.tensor.full_value(slot.name, view))
                      for slot, view in zip(unit.params, unit_views(unit, flat))]
        else:  # each expert under its place in the whole model
            values = whole_values(split, unit, flat[: unit.numel])
            experts[unit.params[0].aliases[0]] = [a for aliases, _ in values for a in aliases]
        for aliases, value in values:
            value = value.to(torch.float32, copy=True)  # bf16 masters come out in fp32, as every other's
            for alias in aliases:
                out[alias] = value if len(aliases) == 1 else value.clone()
    for name in program.persistent_buffers + plan.frozen:
        out[name] = state.buffers[name].detach().clone()
    order = [n for k in program.skeleton.state_dict(keep_vars=True) for n in experts.get(k, [k])]
    return {k: out[k] for k in dict.fromkeys(order) if k in out}


def _compile_options(cfg: Config, compile: bool | Mapping[str, Any] | None) -> CompileConfig:
    """The config's ``compile`` section, or the one ``init_state(compile=...)`` gives instead."""
    if compile is None:
        return cfg.compile
    section = {"enabled": True} if compile is True else {"enabled": False} if compile is False else compile
    return parse_compile({"enabled": True, **section})


def _remat_options(cfg: Config, given: str | Mapping[str, Any] | None) -> ActivationCheckpointingConfig:
    """The config's ``activation_checkpointing`` section, or what ``init_state(activation_checkpointing=...)``
    gives instead."""
    if given is None:
        return cfg.activation_checkpointing
    return parse_activation_checkpointing({"policy": given} if isinstance(given, str) else given)


def _step_fn(options: CompileConfig, pipeline: Pipeline | None) -> Callable[..., TrainState]:
    if pipeline is not None:
        if options.cuda_graph:
            raise NotSupportedError("compile.cuda_graph with pipeline parallelism is not supported by dsfunc "
                                    "(a schedule's point-to-point sends cannot be captured); turn one off")
        if options.enabled and options.scope == "model":
            raise NotSupportedError('compile.scope "model" with pipeline parallelism is not supported by dsfunc '
                                    '(a stage is not the whole model); use compile.scope "units"')
        return pipeline.step_fn()
    step = make_train_step()
    return GraphedStep(step, before_step=check_min_scale, after_step=note_min_scale) if options.cuda_graph else step


def _fit_threads_to_host() -> None:
    """Unless OMP_NUM_THREADS says otherwise, torch's CPU threads on the cores other processes leave free: on a
    busy host one thread per core (torch's default) waits behind the other work, 5-15x slower than fewer."""
    if THREADS_VARIABLE in os.environ:
        return
    busy = busy_cores()
    threads = threads_per_rank(rank_variable("LOCAL_WORLD_SIZE", 1), False, None, busy=busy)
    if threads < torch.get_num_threads():
        logger.warning("[dsfunc] %d CPU core(s) here, other processes' load %.1f: torch runs on %d thread(s) "
                       "instead of %d; set %s to choose", len(os.sched_getaffinity(0)), busy, threads,
                       torch.get_num_threads(), THREADS_VARIABLE)
        torch.set_num_threads(threads)


def _default_device(given: torch.device | str | None = None) -> torch.device:
    if given is not None:
        return torch.device(given)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
