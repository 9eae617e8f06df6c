"""DeepSpeed's ``DeepSpeedEngine`` as a shell over a :class:`~dsfunc.TrainState` and the micro-batch runtime.

The engine holds the current state (``engine.state``) and translates DeepSpeed's calls onto the one
micro-batch runtime :func:`dsfunc.train_step` also uses (:mod:`dsfunc.zero.runtime`; the engine's adds a script's
own backward and the declared boundary, :mod:`dsfunc.deepspeed.engine_runtime`): ``engine(...)``
(or a call of the module itself) is the runtime's ``forward``, ``engine.backward(loss)`` (or
``loss.backward()``) its ``backward`` and ``engine.step()`` its ``end``; at the accumulation boundary
the step's gradients go to :func:`dsfunc.apply_gradients`, which also advances the lr schedule unless
the step overflowed. The engine keeps no gradient logic of its own, so the same config and data give
the same parameters as the functional API, bit for bit.

As in DeepSpeed, the engine is an ``nn.Module`` whose ``module`` is the model passed to ``initialize``,
trained in place (``init_state(..., in_place=True)``): its parameters are views of the state's compute
copies on the engine's device, so after every step they hold the current weights with no copy, and
reading ``engine.module`` is never a collective. Parameters and buffers are the module's own;
attributes the engine does not have are the module's.

* ZeRO 0-2: ``net.state_dict()`` holds the current weights (16-bit under bf16/fp16, as DeepSpeed's
  module), on every rank, so a rank-0-only save works.
* ZeRO 3: parameters of the gathered units are empty outside a forward (``ds_status`` NOT_AVAILABLE,
  ``ds_shape`` the full shape), as DeepSpeed's, so ``net.state_dict()`` holds empty tensors for them.
  A forward through ``net`` outside the engine gathers each unit for its own forward (every rank must
  run it); for the full weights use ``engine.save_16bit_model`` or ``deepspeed.zero.GatheredParameters``
  (collectives too), or ``dsfunc.full_params(engine.state)`` (fp32 masters).

The training loop, as DeepSpeed's: forwards with autograd enabled are training forwards (whatever the
module's mode); under ``torch.no_grad()`` they are evaluations. A micro-batch may hold several forwards
and backwards before its ``engine.step()`` (a GAN); their gradients add up, each backward divided by the
accumulation steps. ``loss.backward()`` instead of ``engine.backward(loss)`` works as in DeepSpeed (under
fp16 use ``engine.scale(loss).backward()``; see :mod:`dsfunc.deepspeed.engine_runtime`); the engine then does not
see the loss, so ``engine.state.metrics.loss`` is nan for such steps. ``zero_grad()`` does nothing: it
never discards the step's gradients, nor the graph of a forward whose backward is still to come.

``load_checkpoint`` also moves the engine's ``training_dataloader`` to where the saved run was, so a
resumed loop sees the same batches (do not skip batches by hand as well).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dsfunc.compile import compile_forwards
from dsfunc.config import parse_compile
from dsfunc.data import DistributedLoader
from dsfunc.deepspeed import direct, live_engines
from dsfunc.deepspeed.engine_config import ConfigAccessors
from dsfunc.deepspeed.engine_surface import EngineSurface, NoSyncError, ScriptOwnsBoundaryError
from dsfunc.deepspeed.lr_schedules import engine_scheduler, hand_built
from dsfunc.deepspeed.step_in_progress import StepInProgress, transformed
from dsfunc.deepspeed.views import GroupView, schedule_count
from dsfunc.deepspeed.zero_context import gathered_state_dict
from dsfunc.deepspeed.zero_optimizer import engine_optimizer
from dsfunc.errors import InputError, NotSupportedError, UsageError
from dsfunc.monitor import Monitor, tokens_in
from dsfunc.state import TrainState
from dsfunc.zero.runtime import Phase

logger = logging.getLogger("dsfunc")

ENGINE_KEY = "dsfunc_engine"  # engine counters inside a checkpoint's client state


class Engine(ConfigAccessors, EngineSurface, nn.Module):
    """DeepSpeed's ``DeepSpeedEngine`` over a :class:`~dsfunc.TrainState` (built by :func:`initialize`).

    The training loop and checkpoints are here; DeepSpeed's config accessors are in
    :mod:`~dsfunc.deepspeed.engine_config`, the rest of its names in :mod:`~dsfunc.deepspeed.engine_surface`.
    """

    def __init__(
        self,
        state: TrainState,
        *,
        model: nn.Module,
        local_rank: int = 0,
        groups: list[GroupView] | None = None,
        param_groups: list[dict[str, Any]] | None = None,
        scheduled: bool = False,
        training_dataloader: DistributedLoader | None = None,
        progress_bar: bool = False,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        if state.program.skeleton is not model:
            raise InputError("the engine trains its module in place: build the state with init_state(model, ..., "
                             "in_place=True)")
        self.module = model
        self.steps = StepInProgress(state, trains=groups is not None)  # shared with direct calls of the module
        self.groups = groups or []  # the parameter groups (none without an optimizer)
        self.local_rank = local_rank
        self.training_dataloader = training_dataloader
        program = state.program
        self.config = program.config
        self.global_rank = program.plan.rank
        self.world_size = program.plan.world_size
        self.monitor = Monitor(state, progress_bar=progress_bar, total_steps=total_steps)
        # a client torch optimizer's param_groups are the engine optimizer's: a scheduler built on either
        # drives the engine's lr, as with DeepSpeed
        self.optimizer = engine_optimizer(self, param_groups) if groups is not None else None
        section = self.config.scheduler.type if self.config.scheduler is not None else None
        self.lr_scheduler = engine_scheduler(self, section) if groups is not None and scheduled else None
        self.global_samples = 0
        self._stepped = False  # whether the last step() ended an optimizer step
        self._stepping = False  # whether step() is running (the boundary when the script owns it)
        self._timings: dict[str, float] = {}
        self._tokens = 0
        self._compiled = self.config.compile.enabled
        self._init_surface()
        self._direct_hooks = direct.install(model, self.steps)
        live_engines.register(self)

    def __getattr__(self, name: str) -> Any:
        """The module's attribute when the engine has none of that name (as DeepSpeed's engine)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None:
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    # -- accessors --------------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """The current training state (replaced at every optimizer step; earlier ones are donated)."""
        return self.steps.state

    @property
    def micro_steps(self) -> int:
        """Micro-batches ended so far (DeepSpeed's counter)."""
        return self.steps.micro_steps

    @property
    def device(self) -> torch.device:
        return self.state.program.device

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped ones included."""
        return int(self.state.step)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients overflowed (reading it waits for the device)."""
        return self.monitor.skipped_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the current micro-batch is the last of its optimizer step; with
        ``managed_gradient_accumulation`` false only while ``step()`` runs (DeepSpeed's: that call is the boundary)."""
        if not self.config.managed_gradient_accumulation:
            return self._stepping
        return self.steps.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the current micro-batch ends the optimizer step (until said otherwise): the next
        ``engine.step()`` then applies the update exactly when it is True, whatever the micro-batch count.
        Several backwards before one ``step()`` are one micro-batch whose gradients add up, each backward
        divided by ``gradient_accumulation_steps`` (accelerate's loop)."""
        if not self.config.managed_gradient_accumulation:
            raise ScriptOwnsBoundaryError("set_gradient_accumulation_boundary() is not supported with "
                                          "managed_gradient_accumulation false: every engine.step() ends the optimizer "
                                          "step (the script owns the boundary)")
        self.steps.boundary = bool(is_boundary)
        self.steps.place()

    def get_lr(self) -> list[float]:
        """The lr the next optimizer step will use, per parameter group (DeepSpeed's list: the optimizer's
        ``param_groups`` lr, which a client may have set)."""
        return self.optimizer.lrs() if self.optimizer is not None else []

    def scheduled_lr(self) -> list[float]:
        """The lr the engine's own schedule (or constant lr) gives the next step, per parameter group."""
        if not self.groups:
            return []
        t = schedule_count(self.state.opt_state) - 1
        return [g.lr_at(t) for g in self.groups]

    def get_global_grad_norm(self) -> float:
        """The global gradient norm of the last optimizer step (unscaled, before clipping); None before the
        first step."""
        return float(self.state.metrics.grad_norm) if self.global_steps else None

    def was_step_applied(self) -> bool:
        """Whether the last ``engine.step()`` applied an update: False off the accumulation boundary, when the
        step was skipped for overflow, and before the first step (as DeepSpeed's)."""
        return self._stepped and not bool(self.state.metrics.skipped)

    def compile(self, backend: str | None = None, compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None) -> None:
        """DeepSpeed's ``engine.compile()``: compile each unit's forward, or the whole model's when the config
        says ``compile.scope = "model"``, as the config's ``compile`` section does (not ``nn.Module.compile``,
        which would compile the engine's own Python)."""
        if schedule is not None:
            raise NotSupportedError("engine.compile(schedule=...) (DeepSpeed's compiler, DeepCompile) is not "
                                    "implemented by dsfunc; engine.compile() compiles each unit's forward, or the "
                                    'whole model\'s with compile.scope "model"')
        if self.is_compiled:
            logger.warning("engine.compile(): the engine is already compiled; nothing to do")
            return
        section = {"enabled": True, "scope": self.config.compile.scope, "kwargs": dict(compile_kwargs or {})}
        if backend is not None:
            section["backend"] = backend
        compile_forwards(self.module, self.state.program.plan, parse_compile(section),
                         self.config.activation_checkpointing)
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._compiled

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients never live on the module's parameters, and the step's gradients so far
        are kept (a forward's graph stays usable: a GAN zeroes one engine between another's forward and
        backward)."""

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's ``state_dict`` (what it holds: see the module docstring for ZeRO-3)."""
        out = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            out = type(out)((k, v) for k, v in out.items() if k not in frozen)
        return out

    # -- the training loop ------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        """Where the current micro-batch is: ``IDLE`` (forward next), ``FORWARD`` (backward next) or
        ``BACKWARD`` (step next, or another forward/backward pair)."""
        return self.steps.phase

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model on ``inputs`` (moved to the engine's device) with the current parameters.

        With autograd enabled (and an optimizer), the outputs carry a graph for :meth:`backward`; under
        ``torch.no_grad()`` it is an evaluation.
        """
        if not self.steps.trains_now():
            return self.steps.for_evaluation().evaluate(_call, (inputs, kwargs), grad_mode=transformed())
        start = self._clock()
        self.tput_timer.start()
        runtime = self.steps.begin()
        self._tokens += tokens_in((inputs, kwargs))
        self.monitor.see(_call, (inputs, kwargs))  # the FLOPs count's micro-batch (the first one only)
        try:
            out = runtime.forward(_call, (inputs, kwargs), micro=self.steps.micro())
        except BaseException:
            self.steps.abandon()
            raise
        self._lap("forward", start)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` (computed from this micro-batch's forwards) into the engine's gradients.

        The seed is ``loss * loss_scale / (gradient_accumulation_steps * world_size)``, so the step's
        gradient is the mean over all micro-batches of all ranks; several backwards before one
        :meth:`step` add up. Returns ``loss / gradient_accumulation_steps`` (``loss`` without
        ``scale_wrt_gas``), as DeepSpeed does.
        """
        if self.optimizer is None:
            raise UsageError(
                'engine.backward() needs an optimizer: add an "optimizer" section to the config or pass '
                "optimizer= to initialize"
            )
        if self.phase is Phase.IDLE:
            raise UsageError(
                "engine.backward() without a training forward: run `loss = criterion(engine(inputs), labels)` "
                "first (forwards under torch.no_grad() are evaluations and build no graph)"
            )
        start = self._clock()
        self.steps.runtime.backward(loss, self.state.scaler.scale, retain_graph=retain_graph,
                               mean_over_micro=scale_wrt_gas)
        self._lap("backward", start)
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, for ``engine.scale(loss).backward()`` (DeepSpeed's manual backward)."""
        if self.phase is Phase.IDLE:
            raise UsageError("engine.scale(loss) without a training forward: run the forward first")
        return self.steps.runtime.scale(loss)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End the micro-batch; at the accumulation boundary apply the update (or skip it on overflow)."""
        self._stepping = True
        try:
            self._step(lr_kwargs)
        finally:
            self._stepping = False

    def _step(self, lr_kwargs: dict[str, Any] | None) -> None:
        if lr_kwargs:
            raise InputError("lr_kwargs is not supported: dsfunc's lr schedule is a function of the step count")
        if self.inside_no_sync_ctxt:
            raise NoSyncError("It is illegal to call Engine.step() inside no_sync context manager (or "
                              "coalesce_grad_reduction): end the with-block first; its backwards go into the step after it")
        if self.steps.runtime is None or self.steps.runtime.micro_backwards == 0:
            raise UsageError(
                "engine.step() before engine.backward() for this micro-batch: call engine(inputs), "
                "engine.backward(loss), engine.step() for every micro-batch"
            )
        start = self._clock()
        backwards = self.steps.runtime.micro_backwards
        lr = self.optimizer.step_lr() if self.steps.is_boundary() else None  # a client's param_groups lr
        self._stepped = self.steps.end_micro_batch()
        if not self._stepped:
            self.tput_timer.stop(global_step=False)
            self._lap("step", start)
            return
        new = self.steps.finish(lr=lr)
        if self._client_scheduler() is not None and not bool(new.metrics.skipped):
            with warnings.catch_warnings():  # the client optimizer's own step() never runs: its shallow copies' do
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before", UserWarning)
                self.lr_scheduler.step()  # as DeepSpeed: it writes the next step's lr into the param_groups
        self.tput_timer.stop(global_step=True)
        # DeepSpeed's count: a step's samples, or those of its backwards when the script owns the boundary
        per_micro = self.train_batch_size() // self.gradient_accumulation_steps()
        self.global_samples += self.train_batch_size() if self.config.managed_gradient_accumulation else (
            per_micro * backwards)
        self._lap("step", start)
        self.monitor.log(new, samples=self.global_samples, tokens=self._tokens * self.world_size,
                         timings=self._timings or None)
        self.last_timings, self._timings, self._tokens = self._timings, {}, 0

    def _client_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The client's torch lr scheduler, which the engine steps (None: the engine's own schedule)."""
        sched = self.lr_scheduler
        return sched if isinstance(sched, torch.optim.lr_scheduler.LRScheduler) or hand_built(sched) else None

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

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the module's weights in the compute dtype (``torch.save`` of a state_dict, rank 0 writes);
        every rank calls it. At ZeRO-3 it gathers one unit at a time, and only with
        ``stage3_gather_16bit_weights_on_model_save`` (else it returns False, as DeepSpeed)."""
        path = os.path.join(save_dir, save_filename)
        if self.zero_optimization_partition_weights():
            if not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
                logger.info("Did not save the model %s because stage3_gather_16bit_weights_on_model_save is False",
                            path)
                return False
            weights = gathered_state_dict(self.module, exclude_frozen_parameters=exclude_frozen_parameters)
        elif self.global_rank == 0:
            held = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
            weights = {k: v.detach().to("cpu", copy=True) for k, v in held.items()}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(weights, path)
        return True

    save_fp16_model = save_16bit_model

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The module's full weights in the compute dtype, as CPU tensors on rank 0 (None elsewhere),
        gathered one unit at a time; every rank calls it. ZeRO-3 only (a ValueError otherwise, as DeepSpeed's)."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("this function requires ZeRO-3 mode")
        return gathered_state_dict(self.module, exclude_frozen_parameters=exclude_frozen_parameters)

    def destroy(self) -> None:
        """Release the engine (DeepSpeed's ``destroy``): its monitor closes and a direct call of its module
        no longer trains through it; the per-parameter helpers stop finding it."""
        self.monitor.close()
        for hook in self._direct_hooks:
            hook.remove()
        self._direct_hooks = []
        live_engines.unregister(self)

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
        ``exclude_frozen_parameters`` leaves out the parameters that do not train (PEFT's base model, as the
        HF Trainer asks); such a checkpoint loads with ``load_module_strict=False``.
        """
        if client_state is not None and client_sd is not None:
            raise InputError("pass the client state once: client_state= or client_sd=, not both")
        client = dict(client_state if client_state is not None else client_sd or {})
        if ENGINE_KEY in client:
            raise InputError(f"client_state key {ENGINE_KEY!r} is reserved for the engine's counters; rename it")
        self.steps.drop_forwards_without_backward()
        if self.steps.runtime is not None:
            raise UsageError(
                f"save_checkpoint in the middle of an optimizer step (micro-batch "
                f"{self.micro_steps % self.gradient_accumulation_steps() + 1} of "
                f"{self.gradient_accumulation_steps()}): its gradients would be lost; save after the "
                "engine.step() that ends the step"
            )
        client[ENGINE_KEY] = {"global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
                              "param_group_lr": self.get_lr()}
        if self._client_scheduler() is not None:
            client[ENGINE_KEY]["lr_scheduler"] = self.lr_scheduler.state_dict()
        self.monitor.flush()
        from dsfunc import checkpoint  # DCP and DTensor load on first use: a second of import time

        checkpoint.save_checkpoint(self.state, save_dir, tag=tag, client_state=client, save_latest=save_latest,
                                   exclude_frozen_parameters=exclude_frozen_parameters)
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
        *,
        trust_pickle: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/<tag>`` (default: the tag in ``load_dir/latest``) into the engine.

        Returns ``(load_path, client_state)``, or ``(None, None)`` (with a warning) when there is nothing
        to load. ``load_module_strict=False`` takes a checkpoint saved with ``exclude_frozen_parameters``
        (the frozen parameters keep the engine's values). ``load_module_only`` loads parameters and buffers
        only; ``load_optimizer_states=False`` keeps fresh optimizer and loss-scaler state,
        ``load_lr_scheduler_states=False`` a fresh schedule. The engine's counters and its ``training_dataloader`` continue from the saved step. Every pickle in
        the checkpoint (the client state, DCP's ``.metadata``, DeepSpeed's files) is read by a restricted
        unpickler, so no code in it runs, unless ``trust_pickle=True`` (see :func:`dsfunc.load_checkpoint`).
        """
        if custom_load_fn is not None:
            raise InputError("custom_load_fn is not supported by dsfunc")
        if self.steps.runtime is not None:
            raise UsageError("load_checkpoint in the middle of an optimizer step; call it between steps")
        from dsfunc import checkpoint  # DCP and DTensor load on first use: a second of import time

        try:
            folder = checkpoint.find_checkpoint(load_dir, tag)
        except checkpoint.CheckpointNotFoundError as e:  # DeepSpeed warns and returns (None, None)
            logger.warning("Unable to load a checkpoint: %s ... skip checkpoint load", e)
            return None, None
        optimizer_from = self._get_optimizer_ckpt_name(folder) if load_optimizer_states and not load_module_only \
            else None
        loaded, client = checkpoint.load_checkpoint(
            folder, self.state, load_optimizer_states=optimizer_from is not None,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            load_module_strict=load_module_strict, trust_pickle=trust_pickle,
        )
        client = dict(client or {})
        counters = client.pop(ENGINE_KEY, None)
        self.steps.state = loaded
        if not load_module_only:
            step = int(loaded.step)
            self.steps.micro_steps = step * self.gradient_accumulation_steps()
            counters = counters or {}
            self.global_samples = counters.get("global_samples", step * self.train_batch_size())
            self.monitor.restart(loaded, skipped_steps=counters.get("skipped_steps", 0))
            if self.optimizer is not None and load_lr_scheduler_states and "param_group_lr" in counters:
                self.optimizer.restore(counters["param_group_lr"])  # a client may have set them
            if self._client_scheduler() is not None and load_lr_scheduler_states and "lr_scheduler" in counters:
                self.lr_scheduler.load_state_dict(counters["lr_scheduler"])
            if self.training_dataloader is not None:
                self.training_dataloader.skip_to(self.micro_steps)
        return str(folder), client

    def _get_optimizer_ckpt_name(self, checkpoint: str | os.PathLike, *args: Any) -> str:
        """Where a checkpoint's optimizer state is read from (DeepSpeed's name for its per-rank optimizer file;
        dsfunc's is in the checkpoint's own folder). Called only when the optimizer state is loaded, as DeepSpeed's
        (its checkpoint tests assert it is not called otherwise)."""
        return str(checkpoint)


DeepSpeedEngine = Engine  # DeepSpeed's name (deepspeed.runtime.engine.DeepSpeedEngine, isinstance checks)


def _call(model: nn.Module, args: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    """The model on a forward's positional and keyword inputs."""
    inputs, kwargs = args
    return model(*inputs, **kwargs)
