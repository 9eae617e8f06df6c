"""The rest of DeepSpeed 0.19's ``DeepSpeedEngine`` surface: parallelism attributes, timers, gradient
contexts, and the names of features dsfunc does not have.

Every public name of DeepSpeed's engine (its methods and the attributes its ``__init__`` sets) answers
on dsfunc's engine: with dsfunc's value (data parallelism is the only parallelism, so the model-parallel
world is 1 and the MoE lists are empty), or, for a feature dsfunc does not implement, with a
:class:`~dsfunc.errors.NotSupportedError` naming it at the call (or at the attribute's read).
``tests/deepspeed/test_engine_surface.py`` checks the list against real DeepSpeed's engine.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import IterableDataset

from dsfunc.data import DistributedLoader, check_dataset
from dsfunc.deepspeed.timers import SynchronizedWallClockTimer, ThroughputTimer
from dsfunc.deepspeed.utils import log_dist, safe_set_full_fp32_param
from dsfunc.errors import InputError, NotSupportedError, UsageError


def _refuse(name: str, feature: str, hint: str = "") -> Any:
    message = f"engine.{name} ({feature}) is not implemented by dsfunc" + (f"; {hint}" if hint else "")

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(message)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not in dsfunc: {message}."
    return refuse


def _refused_attribute(name: str, feature: str, hint: str = "") -> property:
    return property(_refuse(name, feature, hint), doc=f"Not in dsfunc: {feature}.")


_REDUCTION = "DeepSpeed's hand-driven gradient reduction", "dsfunc reduces a step's gradients in engine.step()"
_COMPILE = ("DeepSpeed's compiler passes (DeepCompile, AutoTP, AutoSP)",
            'engine.compile() compiles each unit, or the whole model (compile.scope "model")')

# method -> (the feature, what to do instead)
NOT_SUPPORTED = {
    "allreduce_gradients": _REDUCTION,
    "allreduce_bucket": _REDUCTION,
    "allreduce_and_copy": _REDUCTION,
    "allreduce_no_retain": _REDUCTION,
    "buffered_allreduce_fallback": _REDUCTION,
    "all_gather_scalar": _REDUCTION,
    "sparse_allreduce": ("sparse gradients", ""),
    "sparse_allreduce_bucket": ("sparse gradients", ""),
    "sparse_allreduce_no_retain": ("sparse gradients", ""),
    "sparse_all_gather": ("sparse gradients", ""),
    "compile_zero_optimization_stage": _COMPILE,
    "get_autosp_backend": _COMPILE,
    "get_autotp_backend": _COMPILE,
    "get_deepcompile_backend": _COMPILE,
    "get_deepspeed_compile_backend": _COMPILE,
    "register_compile_pass": _COMPILE,
    "clip_fp32_gradients": ("clipping gradients by hand", "gradient_clipping in the config clips inside the step"),
    "data_efficiency_config": ("data efficiency (curriculum learning, random-LTD)", ""),
    "data_sampling_config": ("data efficiency's data sampling", ""),
    "random_ltd_initialize": ("random layerwise token dropping (data efficiency)", ""),
    "set_custom_curriculum_learning_schedule": ("curriculum learning (data efficiency)", ""),
    "set_data_post_process_func": ("data efficiency's data post-processing", ""),
    "offload_states": ("offloading the engine's states between steps",
                       "configure zero_optimization.offload_optimizer / offload_param instead"),
    "reload_states": ("offloading the engine's states between steps", ""),
    "swap_tensor_config": ("NVMe swapping", ""),
    "tensor_parallel_config": ("tensor parallelism", ""),
    "torch_autocast_lower_precision_safe_modules": ("DeepSpeed's torch_autocast", "use bf16 or fp16"),
    "get_optimizer_configuration": ("DeepSpeed's optimizer selection internals", ""),
    "set_train_batch_size": ("changing the batch size after initialize",
                             "the batch triple is part of the state; build a new engine"),
    "set_train_micro_batch_size": ("changing the batch size after initialize",
                                   "the batch triple is part of the state; build a new engine"),
}

_NOT_SUPPORTED_ATTRIBUTES = {
    "losses": ("the running sum of a step's losses", "read engine.state.metrics.loss after the step"),
    "engine_timers": ("DeepSpeed's internal engine timer lists", "use engine.timers or get_wall_clock_timers()"),
    "checkpoint_engine": ("DeepSpeed's pluggable checkpoint engines",
                          "engine.save_checkpoint writes DCP; see dsfunc.save_checkpoint"),
    "loaded_checkpoint_dp_world_size": ("the saved data-parallel size", "dsfunc checkpoints load at any size"),
    "loaded_checkpoint_mp_world_size": ("model parallelism", ""),
    "module_forward_pre_hook": ("DeepSpeed's forward hook handles", ""),
    "module_forward_post_hook": ("DeepSpeed's forward hook handles", ""),
}


class NoSyncError(UsageError, AssertionError):
    """A call that ``engine.no_sync()`` rules out (a step inside it, nesting, ZeRO-2/3), which DeepSpeed refuses
    with an assertion; the message starts with DeepSpeed's words."""


class ScriptOwnsBoundaryError(UsageError, AssertionError):
    """An accumulation-boundary call on an engine whose script owns the boundary (``managed_gradient_accumulation``
    false), which DeepSpeed refuses with an assertion."""


class EngineSurface:
    """DeepSpeed engine names beyond the training loop and the config accessors (mixed into the engine)."""

    state: Any
    module: torch.nn.Module
    optimizer: Any
    world_size: int
    global_rank: int

    # One model-parallel rank, no experts (the sequence split is the mesh's sp axis: sequence_parallel_size).
    mp_world_size = 1
    mpu = None
    has_moe_layers = False
    pipeline_parallelism = False
    all_to_all_group = None
    local_all_to_all_group = None
    mesh_device = None
    torch_autocast_z0_gradscaler = None
    checkpoint_mp_rank = 0
    zenflow = False
    use_ds_comm = False
    optimized_linear_lora_enabled = False
    optimized_linear_base_weight_sharding = False
    dont_change_device = False
    enable_backward_allreduce = True
    gradient_average = True
    scale_wrt_gas = True
    warn_unscaled_loss = True
    save_zero_checkpoint = True
    inside_no_sync_ctxt = False
    flatten = staticmethod(_flatten_dense_tensors)
    unflatten = staticmethod(_unflatten_dense_tensors)

    # what initialize was given (it sets them)
    client_optimizer: Any = None
    client_lr_scheduler: Any = None
    training_data: Any = None
    collate_fn: Any = None

    def _init_surface(self) -> None:
        """The timers (called by the engine's ``__init__``)."""
        self.last_timings: dict[str, float] = {}
        self.timers = SynchronizedWallClockTimer()
        self.tput_timer = ThroughputTimer(self.state.program.config.train_batch_size)

    # -- parallelism --------------------------------------------------------------------------------
    @property
    def dp_world_size(self) -> int:
        """The ranks this rank's parameters are sharded and averaged over (a pipeline stage's replicas)."""
        return self.state.program.plan.world_size

    @property
    def seq_dp_world_size(self) -> int:
        return self.dp_world_size

    @property
    def data_parallel_group(self) -> Any:
        """The process group gradients are averaged over: the world, or a pipeline stage's replicas (None
        without a process group)."""
        pipeline = self.state.program.run.pipeline
        if pipeline is not None and pipeline.topology.data_group is not None:
            return pipeline.topology.data_group
        return dist.group.WORLD if dist.is_initialized() else None

    seq_data_parallel_group = data_parallel_group

    @property
    def dist_backend(self) -> str | None:
        return dist.get_backend() if dist.is_initialized() else None

    @property
    def expert_parallel_group(self) -> dict[str, Any]:
        return {}

    @property
    def expert_data_parallel_group(self) -> dict[str, Any]:
        return {}

    @property
    def num_experts(self) -> list[int]:
        return []

    @property
    def gate_modules(self) -> list[torch.nn.Module]:
        return []

    @property
    def moe_layers(self) -> list[torch.nn.Module]:
        return []

    @property
    def save_non_zero_checkpoint(self) -> bool:
        """True on the rank that writes the model states (DeepSpeed: data-parallel rank 0)."""
        return self.global_rank == 0

    @property
    def basic_optimizer(self) -> Any:
        """The optimizer the engine steps (the engine's optimizer view; dsfunc has no wrapped inner one)."""
        return self.optimizer

    @property
    def param_names(self) -> dict[torch.nn.Parameter, str]:
        return {p: n for n, p in self.module.named_parameters()}

    def get_data_parallel_rank(self) -> int:
        return self.state.program.plan.rank

    def get_model_parallel_rank(self) -> int:
        return self.get_tensor_parallel_rank()

    def get_tensor_parallel_rank(self) -> int:
        return self.state.program.mesh.group("tp").rank

    @property
    def sequence_parallel_size(self) -> int:
        mesh = self.state.program.mesh
        return mesh.size("sp") if mesh is not None else 1

    def get_sequence_parallel_group(self) -> Any:
        """The mesh's sp process group (None without a sequence split, as dsfunc has no group for it then)."""
        return self.state.program.mesh.group("sp").process_group if self.sequence_parallel_size > 1 else None

    # -- optimizer params ---------------------------------------------------------------------------
    def _group_values(self, key: str) -> list[Any]:
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return [group.get(key, 0.0) for group in groups]

    def get_mom(self) -> list[Any]:
        """Per group: ``momentum`` for SGD/RMSprop, else ``betas`` (DeepSpeed's reading)."""
        name = (self.optimizer_name() or "").lower()
        return self._group_values("momentum" if name in ("sgd", "rmsprop") else "betas")

    def get_type(self) -> list[Any]:
        """Per group: its ``type`` entry (0.0 where it has none, as DeepSpeed)."""
        return self._group_values("type")

    # -- timers -------------------------------------------------------------------------------------
    def get_wall_clock_timers(self) -> dict[str, float]:
        """Milliseconds of the last step's forward, backward and step (filled under ``wall_clock_breakdown``)."""
        return dict(self.last_timings)

    @property
    def engine_timers_cache(self) -> dict[str, float]:
        return self.get_wall_clock_timers()

    def print_forward_breakdown(self, fwd_time: float) -> None:
        log_dist(f"time (ms) | fwd: {fwd_time:.2f}", ranks=[0])

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now (at a boundary the script chooses); what it collected."""
        return gc.collect()

    def get_compile_time(self) -> list[float]:
        """DeepCompile's compile times: none (dsfunc compiles with torch.compile; see ``compile``)."""
        return []

    # -- gradient contexts --------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate into the current step without a reduction; ``engine.step()`` inside is
        an error. dsfunc reduces a step's gradients only when the step ends, so nothing else changes; as in
        DeepSpeed, ZeRO-2/3 refuse it (their gradients are partitioned by the reduction)."""
        stage = self.state.program.config.zero_optimization.stage
        if stage >= 2:
            raise NoSyncError(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                              f"{stage} (as in DeepSpeed); accumulate with gradient_accumulation_steps instead")
        with self._without_step("engine.no_sync()"):
            yield

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """All backwards inside go into one optimizer step, reduced once (as every dsfunc step already is);
        ``engine.step()`` inside is an error."""
        if not self.state.program.config.managed_gradient_accumulation:
            raise ScriptOwnsBoundaryError("coalesce_grad_reduction is not supported with managed_gradient_accumulation "
                                          "false: the script owns the accumulation boundary through engine.step()")
        with self._without_step("engine.coalesce_grad_reduction()"):
            yield

    @contextlib.contextmanager
    def _without_step(self, what: str) -> Iterator[None]:
        if self.inside_no_sync_ctxt:
            raise NoSyncError(f"no_sync context manager reentry is unsupported: {what} inside engine.no_sync() or "
                              "engine.coalesce_grad_reduction(); they do not nest")
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    # -- weights and memory -------------------------------------------------------------------------
    def load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True, custom_load_fn: Any = None,
                               fetch_z3_params: bool = False, z3_params_to_fetch: Any = None,
                               allowed_missing_keys: Any = None) -> None:
        """Make ``checkpoint["module"]`` (or ``checkpoint`` itself, a module state_dict) the engine's weights:
        parameters become the fp32 masters (and their compute copies), buffers are copied. Every rank calls
        it with the full weights."""
        if custom_load_fn is not None:
            raise InputError("custom_load_fn is not supported by dsfunc")
        weights = checkpoint.get("module", checkpoint)
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        allowed = set(allowed_missing_keys or ())
        missing = [k for k in list(params) + list(buffers) if k not in weights and k not in allowed]
        unexpected = [k for k in weights if k not in params and k not in buffers]
        if strict and (missing or unexpected):
            raise InputError(f"load_module_state_dict: missing keys {missing}, unexpected keys {unexpected}; "
                             "pass strict=False to load what matches")
        for name, value in weights.items():
            if name in params:
                safe_set_full_fp32_param(params[name], value.to(torch.float32))
            elif name in buffers:
                with torch.no_grad():
                    buffers[name].copy_(value)

    def empty_partition_cache(self) -> None:
        """Nothing to release: dsfunc frees a ZeRO-3 unit's gathered parameters as soon as it is used."""

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: int | None = None) -> DistributedLoader:
        """A loader of this rank's micro-batches of ``dataset`` (what ``initialize(training_data=)`` returns)."""
        if data_sampler is not None:
            raise InputError("deepspeed_io(data_sampler=...) is not supported: dsfunc's loader shards the dataset "
                             "by rank itself")
        check_dataset(dataset)
        cfg = self.state.program.config
        return DistributedLoader(
            dataset, batch_size or cfg.train_micro_batch_size_per_gpu, rank=self.get_data_parallel_rank(),
            world_size=self.dp_world_size, drop_last=cfg.dataloader_drop_last,
            collate_fn=collate_fn or self.collate_fn, num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.state.program.device.type == "cuda",
        )

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, IterableDataset)

    @staticmethod
    def load_moe_state_dict(*args: Any, **kwargs: Any) -> None:
        raise NotSupportedError("engine.load_moe_state_dict (mixture of experts) is not implemented by dsfunc")


for _name, (_feature, _hint) in NOT_SUPPORTED.items():
    setattr(EngineSurface, _name, _refuse(_name, _feature, _hint))
for _name, (_feature, _hint) in _NOT_SUPPORTED_ATTRIBUTES.items():
    setattr(EngineSurface, _name, _refused_attribute(_name, _feature, _hint))
del _name, _feature, _hint
