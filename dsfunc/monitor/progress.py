"""Progress lines, timings and event files for a training run (rank 0 writes; every rank may call).

:class:`Monitor` reads what a run is configured to report from the DeepSpeed config in the state:

* ``steps_per_print: N`` (default 10, as DeepSpeed's; ``null`` turns it off) — every N optimizer steps,
  one progress line on rank 0 (DeepSpeed's ``step=.., skipped=..`` and ``SamplesPerSec`` lines in one)::

      [dsfunc] step=20, skipped=0, loss=1.2345, lr=[0.001], loss_scale=1, grad_norm=0.4321,
      RunningAvgSamplesPerSec=812.3, CurrSamplesPerSec=830.1, tflops=412.5, mfu=41.70%,
      MemAllocated=0.01GB, MaxMemAllocated=0.02GB

  ``loss``/``lr``/``loss_scale``/``grad_norm`` are the printed step's own values (``lr`` is the lr
  that step used), ``skipped`` counts overflowed steps so far, samples/s are global (all ranks), the
  running average leaves out the first two steps (as DeepSpeed's throughput timer), ``TokensPerSec``
  is added when the batch carries token ids (an integer tensor with a sequence dimension), and memory
  is the CUDA allocator's (the process's resident set on a CPU run: ``RSS``/``MaxRSS``). ``tflops`` (model
  TFLOP/s per rank, over the interval of ``CurrSamplesPerSec``) and ``mfu`` (over the device's peak) come from
  FLOPs counted once on a meta copy of the model (:mod:`~dsfunc.monitor.utilisation`); ``mfu`` is left out
  where no peak is known (the CPU: set ``flops_profiler.peak_tflops``). At start-up
  it also prints the ZeRO stage and the per-rank memory estimate (:func:`memory_estimate`), and logs the
  effective config (every key, resolved) to the ``dsfunc`` logger at INFO.
* ``wall_clock_breakdown: true`` — a ``time (ms) | forward: .. | backward: .. | step: ..`` line with
  the mean per optimizer step since the last print (the engine measures these; functional users pass
  ``timings=``), and ``Train/Samples/elapsed_time_ms_{forward,backward,step}`` events.
* ``csv_monitor`` / ``tensorboard`` (``enabled``, ``output_path``, ``job_name``) — events in
  ``os.path.join(output_path, job_name)`` with x = global samples: ``Train/Samples/train_loss``,
  ``Train/Samples/lr`` and, with fp16, ``Train/Samples/loss_scale``. CSV writes one file per event as
  DeepSpeed does (``Train_Samples_lr.csv``, header ``step,lr``); TensorBoard needs the optional
  ``tensorboard`` package. ``wandb`` (``project``, ``group``, ``team``) and ``comet`` log the same events
  to a wandb run or a Comet experiment (packages ``wandb``, ``comet_ml``).
* ``flops_profiler`` (``enabled``, ``profile_step``, ``module_depth``, ``top_modules``, ``detailed``,
  ``output_file``) — after the step that starts at ``profile_step``, DeepSpeed's FLOPs profile of the model
  (:mod:`~dsfunc.monitor.profile`) on stdout or in ``output_file``.

Reading a metric waits for the step, so the monitor keeps each step's values on the device and reads
them in one go when it prints or flushes (every ``steps_per_print`` steps, else every 100 steps, and at
:meth:`Monitor.close`). Functional use::

    monitor = dsfunc.monitor.Monitor(state)
    for batch in dsfunc.data.batches(dataset, state, steps=1000):
        state = dsfunc.train_step(state, batch)
        monitor.log(state, batch)
    monitor.close()
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from dsfunc.batch import split_batch
from dsfunc.config.dtypes import dtype_name
from dsfunc.distributed import comm
from dsfunc.errors import InputError, MissingDependencyError
from dsfunc.grad import compute_loss
from dsfunc.monitor.comet import CometMonitor
from dsfunc.monitor.profile import profile_text
from dsfunc.monitor.timing import ModuleTimer
from dsfunc.monitor.utilisation import Utilisation
from dsfunc.monitor.wandb import WandbMonitor
from dsfunc.monitor.writers import CsvMonitor, TensorBoardMonitor
from dsfunc.zero.memory import memory_estimate

_log = logging.getLogger("dsfunc")
TIMERS = ("forward", "backward", "step")
THROUGHPUT_START_STEP = 2  # DeepSpeed's ThroughputTimer leaves out the first two steps


def effective_config(state: Any) -> str:
    """The resolved config as one JSON line (every key, defaults filled in)."""
    return "[dsfunc] effective config: " + json.dumps(state.program.config.to_dict(), sort_keys=True, default=str)


def startup_summary(state: Any) -> str:
    """What runs: the ZeRO stage, the parameter count and the per-rank memory estimate, as printable text."""
    program = state.program
    plan = program.plan
    est = memory_estimate(state)
    mib = {k: v / 2**20 for k, v in est.items()}
    params = sum(u.numel for u in plan.units)
    master = _master_words(state)
    frozen = sum(state.buffers[n].numel() for n in plan.frozen)
    lines = [
        f"[dsfunc] ZeRO stage {plan.stage} over {plan.world_size} rank(s), {params:,} trainable parameters"
        + (f" ({frozen:,} frozen)" if frozen else "")
        + f" in {len(plan.units)} unit(s), compute dtype {str(program.compute_dtype).replace('torch.', '')}",
        (
            "[dsfunc] model states per rank (estimate, no activations): "
            f"{mib['total']:.2f} MiB = {master} {mib['master']:.2f} + optimizer {mib['optimizer']:.2f} "
            f"+ gradients {mib['gradients']:.2f} + compute copy {mib['compute']:.2f} + buffers {mib['buffers']:.2f}"
            + (f" + host buffers {mib['host_buffers']:.2f}" if est["host"] else "")
        ),
    ]
    if est["host"]:
        lines.append(
            f"[dsfunc] ZeRO-Offload: {mib['device']:.2f} MiB on the device, {mib['host']:.2f} MiB in host memory "
            f"({master}, optimizer state and host buffers)"
            + program.run.placement.summary
        )
    return "\n".join(lines)


def _master_words(state: Any) -> str:
    """What the masters are: ``fp32 master``, ``bf16 master`` or ``bf16 master + compensation`` (Kahan)."""
    dtypes = sorted({dtype_name(p.dtype) for p in state.params.values()})
    kahan = state.program.config.bf16.rounding == "kahan"
    return "/".join(dtypes) + " master" + (" + compensation" if kahan else "")


def tokens_in(batch: Any) -> int:
    """Token count of a batch: elements of its first integer tensor with a sequence dimension (``[B, T]``
    token ids), else 0."""
    for t in optree.tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
            return t.numel()
    return 0


def memory_text(device: torch.device) -> str:
    """``MemAllocated=..GB, MaxMemAllocated=..GB`` (CUDA), or the process's ``RSS=..GB, MaxRSS=..GB``."""
    gb = 2**30
    if device.type == "cuda":
        return (f"MemAllocated={torch.cuda.memory_allocated(device) / gb:.2f}GB, "
                f"MaxMemAllocated={torch.cuda.max_memory_allocated(device) / gb:.2f}GB")
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return f"RSS={rss / gb:.2f}GB, MaxRSS={max_rss / gb:.2f}GB"


def _stdout(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


class Monitor:
    """Progress, timings, event files and an optional tqdm bar for a run; call :meth:`log` after each step.

    Args:
      state: the run's :class:`~dsfunc.TrainState` (config, rank and world size come from it).
      progress_bar: show a tqdm bar on rank 0 (needs ``tqdm``); its postfix shows the loss at each flush.
      total_steps: the bar's total.
      skipped_steps: overflowed steps before this monitor started (when resuming).
      write: where progress lines go (default: print to stdout).
      flush_every: steps between reads of the buffered metrics (default: steps_per_print, else 100).
      peak_tflops: the device's peak TFLOP/s for ``mfu`` (default: the config's ``flops_profiler.peak_tflops``,
        else dsfunc's table of GPUs).
    """

    def __init__(
        self,
        state: Any,
        *,
        progress_bar: bool = False,
        total_steps: int | None = None,
        skipped_steps: int = 0,
        write: Callable[[str], None] | None = None,
        flush_every: int | None = None,
        peak_tflops: float | None = None,
    ) -> None:
        program = state.program
        config = program.config
        self.device = program.device
        self.rank = comm.rank()  # the world's (a pipeline stage's plan ranks only its data-parallel replicas)
        self.world_size = program.plan.world_size
        self.train_batch_size = config.train_batch_size
        self.steps_per_print = config.steps_per_print
        self.wall_clock_breakdown = config.wall_clock_breakdown
        self.log_loss_scale = config.fp16.enabled
        self.flush_every = flush_every or self.steps_per_print or 100
        self.write = write or _stdout
        self.is_writer = self.rank == 0
        self.writers: list[Any] = []
        if self.is_writer:
            if config.csv_monitor.enabled:
                self.writers.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
            if config.tensorboard.enabled:
                self.writers.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
            if config.wandb.enabled:
                self.writers.append(WandbMonitor(config.wandb))
            if config.comet.enabled:
                self.writers.append(CometMonitor(config.comet))
        self.enabled = any(c.enabled for c in (config.tensorboard, config.csv_monitor, config.wandb, config.comet))
        self.profiler = config.flops_profiler
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.loss_fn = program.loss_fn
        # FLOPs are counted on rank 0, for its lines; a pipeline stage's skeleton is not the whole model
        counts = self.steps_per_print is not None or self.profiler.enabled
        self.utilisation = (Utilisation(state, peak_tflops) if self.is_writer and counts and program.run.pipeline is None
                            else None)
        self.bar = None
        if progress_bar and self.is_writer:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                raise MissingDependencyError("progress_bar=True needs tqdm: `pip install tqdm`") from None
            self.bar = tqdm(total=total_steps, initial=int(state.step), unit="step", dynamic_ncols=True)
        self._skipped = torch.tensor(skipped_steps, dtype=torch.int64, device=self.device)
        self._unflushed: list[tuple[int, int, tuple[torch.Tensor, ...], dict[str, float]]] = []
        self._timings: dict[str, float] = dict.fromkeys(TIMERS, 0.0)
        self._timed_steps = 0
        self._tokens = 0
        self._last_step = int(state.step)
        self._last_print = (self._last_step, time.perf_counter(), 0)  # (step, time, tokens)
        self._start: tuple[int, float] | None = None
        self._profile_start = time.perf_counter()  # when the profiled step started (profile_step 0: now)
        self._timer: ModuleTimer | None = None  # each module's forward time in the profiled step
        self._timed = self.profiler.enabled and self.utilisation is not None and not config.compile.enabled
        if self._timed and self.profiler.profile_step == int(state.step):
            self._timer = ModuleTimer(program.skeleton, self.device)
        self.skeleton = program.skeleton
        self._closed = False
        if self.is_writer and self.steps_per_print is not None:
            self.write(startup_summary(state))
            _log.info("%s", effective_config(state))  # the whole config: on the "dsfunc" logger, not in the output
        if self.writers or self.bar is not None:
            atexit.register(self.close)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for overflow (reading it waits for the last step)."""
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped.fill_(value)

    def see(self, run: Callable[[Any, Any], Any], micro_batch: Any) -> None:
        """Show the monitor how the model runs on a micro-batch (``run(model, micro_batch)``), for the FLOPs
        count; :meth:`log` does it from its ``batch``, the engine from its first training forward. Only the first
        one is kept (its shapes)."""
        if self.utilisation is not None and not self.utilisation.seen:
            self.utilisation.see(run, micro_batch)

    def write_events(self, events: list[tuple[str, Any, int]]) -> None:
        """Write ``(name, value, x)`` events of the script's own to every event writer now, from rank 0 (DeepSpeed's
        ``engine.monitor.write_events``; ``enabled`` says whether any writer is configured)."""
        rows = [(name, float(value), int(x)) for name, value, x in events]
        for writer in self.writers:
            writer.write_events(rows)

    def restart(self, state: Any, skipped_steps: int = 0) -> None:
        """Continue from ``state`` (after loading a checkpoint): flush, then count from its step."""
        self.flush()
        self._skipped.fill_(skipped_steps)
        self._last_step = int(state.step)
        self._last_print = (self._last_step, time.perf_counter(), self._tokens)
        self._start = None

    def log(
        self,
        state: Any,
        batch: Any = None,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        timings: Mapping[str, float] | None = None,
    ) -> None:
        """Record the step ``state`` just took; print, write events or move the bar when it is time.

        Args:
          state: the state returned by the step.
          batch: this rank's batch of that step (only its shapes are read, for tokens/s).
          samples: global samples so far (default: ``state.step * train_batch_size``).
          tokens: global tokens of this step (default: from ``batch``, times the world size).
          timings: milliseconds this step spent in ``forward``/``backward``/``step`` (any subset).
        """
        step = int(state.step)
        if step == self._last_step:
            raise InputError(
                f"Monitor.log got the same step ({step}) twice: call it once after each optimizer step"
            )
        self._last_step = step
        metrics = state.metrics
        self._skipped += metrics.skipped
        if tokens is None and batch is not None:
            tokens = tokens_in(batch) * self.world_size
        self._tokens += tokens or 0
        for name, ms in (timings or {}).items():
            if name not in self._timings:
                raise InputError(f"unknown timer {name!r}; timers are {list(TIMERS)}")
            self._timings[name] += ms
        self._timed_steps += 1 if timings else 0
        if not self.is_writer:
            return
        if batch is not None and self.utilisation is not None and not self.utilisation.seen:
            micro = split_batch(batch, self.gradient_accumulation_steps, None)[0]
            self.see(lambda model, b, loss_fn=self.loss_fn: compute_loss(loss_fn, model, b), micro)
        if self.profiler.enabled and step in (self.profiler.profile_step, self.profiler.profile_step + 1):
            self._profile(step, timings)
        if self._start is None and step >= THROUGHPUT_START_STEP:
            self._sync()
            self._start = (step, time.perf_counter())
        samples = step * self.train_batch_size if samples is None else samples
        if self.writers or self.bar is not None:
            kept = (metrics.loss.clone(), metrics.lr.clone(), metrics.loss_scale.clone())
            self._unflushed.append((step, samples, kept, dict(timings or {})))
        if self.bar is not None:
            self.bar.update(1)
        if self.steps_per_print is not None and step % self.steps_per_print == 0:
            self._print(state, step)
        if len(self._unflushed) >= self.flush_every:
            self.flush()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _print(self, state: Any, step: int) -> None:
        self._count_flops()
        m = state.metrics.to_dict()
        skipped = self.skipped_steps
        now = time.perf_counter()
        last_step, last_time, last_tokens = self._last_print
        parts = [
            f"step={step}", f"skipped={skipped}", f"loss={m['loss']:.4f}", f"lr=[{m['lr']:.6g}]",
            f"loss_scale={m['loss_scale']:g}", f"grad_norm={m['grad_norm']:.4f}",
        ]
        if self._start is not None and step > self._start[0]:
            running = (step - self._start[0]) * self.train_batch_size / (now - self._start[1])
            parts.append(f"RunningAvgSamplesPerSec={running:.2f}")
        interval = now - last_time
        if step > last_step and interval > 0:
            rate = (step - last_step) * self.train_batch_size / interval
            parts.append(f"CurrSamplesPerSec={rate:.2f}")
            if self._tokens > last_tokens:
                parts.append(f"TokensPerSec={(self._tokens - last_tokens) / interval:.2f}")
            if self.utilisation is not None:
                parts.extend(self.utilisation.line_parts(rate / self.world_size))
        parts.append(memory_text(self.device))
        self.write("[dsfunc] " + ", ".join(parts))
        if self.wall_clock_breakdown and self._timed_steps:
            means = " | ".join(f"{k}: {v / self._timed_steps:.2f}" for k, v in self._timings.items())
            self.write(f"[dsfunc] time (ms) | {means}")
        self._timings = dict.fromkeys(TIMERS, 0.0)
        self._timed_steps = 0
        self._last_print = (step, now, self._tokens)

    def _count_flops(self) -> None:
        """Count the model's FLOPs (once: at the first line or profile that shows them) and say so in a line; the
        time that takes is left out of the samples/s and latencies."""
        u = self.utilisation
        if u is None or not u.seen or u.count is not None or u.failure is not None:
            return
        began = time.perf_counter()
        u.counted()
        self.write(u.summary())
        spent = time.perf_counter() - began
        step, t, tokens = self._last_print
        self._last_print = (step, t + spent, tokens)
        if self._start is not None:
            self._start = (self._start[0], self._start[1] + spent)
        self._profile_start += spent

    def _profile(self, step: int, timings: Mapping[str, float] | None) -> None:
        """Time the step after ``profile_step`` steps; after it, print its FLOPs profile (rank 0)."""
        if step == self.profiler.profile_step + 1:
            self._count_flops()
        self._sync()
        now = time.perf_counter()
        if step == self.profiler.profile_step:
            self._profile_start = now
            if self._timed:
                self._timer = ModuleTimer(self.skeleton, self.device)
            return
        module_latency = self._timer.remove() if self._timer is not None else None
        self._timer = None
        count = self.utilisation.count if self.utilisation is not None else None
        if count is None:
            u = self.utilisation
            why = ("each pipeline stage holds a part of the model" if u is None else
                   "the model's FLOPs could not be counted" if u.seen else "Monitor.log was given no batch")
            self.write(f"[dsfunc] flops_profiler: no profile ({why})")
            return
        latency = {"iter": now - self._profile_start} | {k: ms / 1000 for k, ms in (timings or {}).items()}
        text = profile_text(count, step=step, module_depth=self.profiler.module_depth,
                            top_modules=self.profiler.top_modules, detailed=self.profiler.detailed,
                            world_size=self.world_size, micro_batches=self.gradient_accumulation_steps,
                            recompute_fwd_factor=self.profiler.recompute_fwd_factor, latency=latency,
                            module_latency=module_latency)
        if self.profiler.output_file:
            path = os.path.abspath(self.profiler.output_file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
        else:
            self.write(text)

    def flush(self) -> None:
        """Read the buffered metrics (one wait for the device) and write them to the event files and bar."""
        if not self._unflushed:
            return
        records, self._unflushed = self._unflushed, []
        values = torch.stack([torch.stack([v.float() for v in kept]) for _, _, kept, _ in records]).tolist()
        events: list[tuple[str, float, int]] = []
        for (step, samples, _, timings), (loss, lr, scale) in zip(records, values):
            events.append(("Train/Samples/train_loss", loss, samples))
            events.append(("Train/Samples/lr", lr, samples))
            if self.log_loss_scale:
                events.append(("Train/Samples/loss_scale", scale, samples))
            if self.wall_clock_breakdown:
                events.extend((f"Train/Samples/elapsed_time_ms_{k}", v, samples) for k, v in timings.items())
        for writer in self.writers:
            writer.write_events(events)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{values[-1][0]:.4f}", refresh=False)

    def close(self) -> None:
        """Flush and close the event files and the bar (idempotent; also run at interpreter exit)."""
        if self._closed:
            return
        self.flush()
        for writer in self.writers:
            writer.close()
        if self.bar is not None:
            self.bar.close()
        self._closed = True
