"""DeepSpeed's ``DeepSpeedEngine`` as a shell over a :class:`~dsfunc.TrainState` and the micro-batch runtime.

The engine holds the current state (``engine.state``) and translates DeepSpeed's three calls onto the
one micro-batch runtime :func:`dsfunc.train_step` also uses (:mod:`dsfunc.zero.runtime`):
``engine(...)`` is the runtime's ``forward``, ``engine.backward(loss)`` its ``backward`` and
``engine.step()`` its ``end``; at the accumulation boundary the step's gradients go to
:func:`dsfunc.apply_gradients`, which also advances the lr schedule unless the step overflowed. The
engine keeps no gradient logic of its own, so the same config and data give the same parameters as
the functional API, bit for bit.

Where dsfunc differs from DeepSpeed (each is a clear error or documented here):

* Call ``forward``, ``backward`` and ``step`` once each per micro-batch, in that order.
* ``engine.eval()`` or ``torch.no_grad()`` makes forwards evaluations: no graph, nothing to backward.
* ``engine.module`` is the model you passed, refreshed with the current weights when you read it: a
  gather of all parameters (every rank must read it at ZeRO stages 1-3) and a copy into the module,
  once per optimizer step. dsfunc trains its own copy, so the module's own parameters go stale between
  reads and writing to them changes nothing.
* ``load_checkpoint`` also moves the engine's ``training_dataloader`` to where the saved run was, so a
  resumed loop sees the same batches (do not skip batches by hand as well).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dsfunc import checkpoint
from dsfunc.data import DistributedLoader
from dsfunc.deepspeed.views import EngineLRScheduler, EngineOptimizer, schedule_count
from dsfunc.errors import InputError, UsageError
from dsfunc.init import full_params
from dsfunc.monitor import Monitor, tokens_in
from dsfunc.schedules import Schedule
from dsfunc.state import TrainState
from dsfunc.step import apply_gradients, check_min_scale
from dsfunc.zero.runtime import MicroBatchRuntime, Phase, zero_runtime

logger = logging.getLogger("dsfunc")

ENGINE_KEY = "dsfunc_engine"  # engine counters inside a checkpoint's client state


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
        self._runtime: MicroBatchRuntime | None = None  # the optimizer step in progress
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
        return [float(self._schedule(schedule_count(self._state.opt_state) - 1))]

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
    @property
    def phase(self) -> Phase:
        """Where the current micro-batch is: ``IDLE`` (forward next), ``FORWARD`` (backward next) or
        ``BACKWARD`` (step next)."""
        return self._runtime.phase if self._runtime is not None else Phase.IDLE

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model on ``inputs`` (moved to the engine's device) with the current parameters.

        In training mode with autograd enabled, the outputs carry a graph for :meth:`backward`; in
        :meth:`eval` mode or under ``torch.no_grad()`` it is an evaluation.
        """
        if not (torch.is_grad_enabled() and self.training and self.optimizer is not None):
            return self._evaluate(inputs, kwargs)
        if self.phase is Phase.FORWARD:
            raise UsageError(
                "engine(...) was called again before engine.backward() for the previous forward: call "
                "engine.backward(loss) and engine.step() after each training forward (evaluate under "
                "torch.no_grad() or after engine.eval())"
            )
        if self.phase is Phase.BACKWARD:
            raise UsageError("engine.step() must follow engine.backward() before the next forward")
        start = self._clock()
        if self._runtime is None:
            check_min_scale(self._state)
            self._runtime = zero_runtime(self._state)
        gas = self.gradient_accumulation_steps()
        self._tokens += tokens_in((inputs, kwargs))
        try:
            out = self._runtime.forward(_call, (inputs, kwargs), micro=(self.micro_steps % gas, gas))
        except BaseException:
            self._abandon_step()
            raise
        self._lap("forward", start)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` (computed from this micro-batch's forward) into the engine's gradients.

        The seed is ``loss * loss_scale / (gradient_accumulation_steps * world_size)``, so the step's
        gradient is the mean over all micro-batches of all ranks. Returns ``loss``.
        """
        if self.optimizer is None:
            raise UsageError(
                'engine.backward() needs an optimizer: add an "optimizer" section to the config or pass '
                "optimizer= to initialize"
            )
        if self.phase is Phase.IDLE:
            raise UsageError(
                "engine.backward() without a training forward: run `loss = criterion(engine(inputs), labels)` "
                "first (forwards under torch.no_grad() or engine.eval() are evaluations and build no graph)"
            )
        if self.phase is Phase.BACKWARD:
            raise UsageError("engine.backward() was already called for this forward; call engine.step() next")
        start = self._clock()
        self._runtime.backward(loss, self._state.scaler.scale, retain_graph=retain_graph,
                               mean_over_micro=scale_wrt_gas)
        self._lap("backward", start)
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End the micro-batch; at the accumulation boundary apply the update (or skip it on overflow)."""
        if lr_kwargs:
            raise InputError("lr_kwargs is not supported: dsfunc's lr schedule is a function of the step count")
        if self.phase is not Phase.BACKWARD:
            raise UsageError(
                "engine.step() before engine.backward() for this micro-batch: call engine(inputs), "
                "engine.backward(loss), engine.step() for every micro-batch"
            )
        start = self._clock()
        self._runtime.end()
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            self._lap("step", start)
            return
        loss, grads = self._runtime.finish()
        self._runtime = None
        state = self._state
        new = apply_gradients(state, grads, loss)
        state.mark_donated()
        self._state = new
        self.global_samples += self.train_batch_size()
        self._lap("step", start)
        self.monitor.log(new, samples=self.global_samples, tokens=self._tokens * self.world_size,
                         timings=self._timings or None)
        self._timings, self._tokens = {}, 0

    def _evaluate(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.phase is Phase.FORWARD:
            raise UsageError(
                "an evaluation forward (torch.no_grad() or engine.eval()) while a training forward waits for "
                "engine.backward(); finish that micro-batch first"
            )
        return zero_runtime(self._state).evaluate(_call, (inputs, kwargs))

    def _abandon_step(self) -> None:
        """After a failed forward: drop this optimizer step's micro-batches and start it again."""
        self._runtime = None
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
            raise InputError("pass the client state once: client_state= or client_sd=, not both")
        if exclude_frozen_parameters:
            raise InputError("exclude_frozen_parameters=True is not supported: dsfunc checkpoints keep frozen "
                             "parameters with the buffers")
        client = dict(client_state if client_state is not None else client_sd or {})
        if ENGINE_KEY in client:
            raise InputError(f"client_state key {ENGINE_KEY!r} is reserved for the engine's counters; rename it")
        if self._runtime is not None:
            raise UsageError(
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
        *,
        trust_pickle: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/<tag>`` (default: the tag in ``load_dir/latest``) into the engine.

        Returns ``(load_path, client_state)``, or ``(None, None)`` (with a warning) when there is nothing
        to load. ``load_module_only`` loads parameters and buffers only; ``load_optimizer_states=False``
        keeps fresh optimizer and loss-scaler state, ``load_lr_scheduler_states=False`` a fresh schedule.
        The engine's counters and its ``training_dataloader`` continue from the saved step. The client
        state is read with ``torch.load(weights_only=True)`` unless ``trust_pickle=True`` (see
        :func:`dsfunc.load_checkpoint`).
        """
        if not load_module_strict:
            raise InputError("load_module_strict=False is not supported: a checkpoint must match the model")
        if custom_load_fn is not None:
            raise InputError("custom_load_fn is not supported by dsfunc")
        if self._runtime is not None:
            raise UsageError("load_checkpoint in the middle of an optimizer step; call it between steps")
        try:
            folder = checkpoint.find_checkpoint(load_dir, tag)
        except checkpoint.CheckpointNotFoundError as e:  # DeepSpeed warns and returns (None, None)
            logger.warning("Unable to load a checkpoint: %s ... skip checkpoint load", e)
            return None, None
        loaded, client = checkpoint.load_checkpoint(
            folder, self._state, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            trust_pickle=trust_pickle,
        )
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
        return str(folder), client


def _call(model: nn.Module, args: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    """The model on a forward's positional and keyword inputs."""
    inputs, kwargs = args
    return model(*inputs, **kwargs)
