"""DeepSpeed's timers: ``engine.timers`` (named wall-clock timers) and ``engine.tput_timer`` (throughput).

Scripts time their own phases with ``engine.timers("name").start()/stop()`` and read
``engine.tput_timer.avg_samples_per_sec()``; DeepSpeed-Chat counts epochs with
``engine.tput_timer.update_epoch_count()``. The engine starts ``tput_timer`` at a micro-batch's forward and
stops it at ``engine.step()``, as DeepSpeed's does. Neither prints: the progress lines of
:mod:`dsfunc.monitor` already report throughput every ``steps_per_print`` steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from dsfunc.deepspeed.utils import log_dist


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """One named timer: intervals between ``start()`` and ``stop()`` add up until ``reset()``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started_ = False
        self._start = 0.0
        self._elapsed = 0.0  # seconds since the last reset
        self._intervals: list[float] = []

    def start(self) -> None:
        if self.started_:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        _synchronize()
        self._start = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        if not self.started_:
            raise RuntimeError(f"timer {self.name!r} is not started")
        _synchronize()
        interval = time.perf_counter() - self._start
        self.started_ = False
        if reset:
            self._elapsed = 0.0
        self._elapsed += interval
        if record:
            self._intervals.append(interval)

    def reset(self) -> None:
        self.started_ = False
        self._elapsed = 0.0
        self._intervals.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds timed since the last reset (a running timer counts up to now)."""
        running = self.started_
        if running:
            self.stop()
        out = self._elapsed * 1000
        if reset:
            self._elapsed = 0.0
        if running:
            self.start()
        return out

    def mean(self) -> float:
        """The mean recorded interval (``stop(record=True)``), in milliseconds."""
        return 1000 * sum(self._intervals) / len(self._intervals) if self._intervals else 0.0


class SynchronizedWallClockTimer:
    """Named :class:`Timer` s created on first use: ``timers("forward").start()``."""

    def __init__(self) -> None:
        self.timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self.timers:
            self.timers[name] = Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, Timer]:
        return self.timers

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks: list[int] | None = None) -> None:
        """Log ``name: ms`` of each timer (divided by ``normalizer``) on ``ranks`` (default rank 0)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        parts = [f"{name}: {self(name).elapsed(reset=reset) / normalizer:.2f}" for name in names
                 if name in self.timers]
        log_dist("time (ms) | " + " | ".join(parts), ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Each timer's mean recorded interval in milliseconds, divided by ``normalizer``."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        out = {}
        for name in names:
            if name in self.timers:
                out[name] = self.timers[name].mean() / normalizer
                if reset:
                    self.timers[name].reset()
        return out


class ThroughputTimer:
    """Samples per second over the optimizer steps after the first ``start_step`` (DeepSpeed's warm-up)."""

    def __init__(self, batch_size: int, start_step: int = 2) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds, over the timed steps
        self.started = False
        self._start: float | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            _synchronize()
            self._start = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-batch (``global_step``: the last of its optimizer step). Reports nothing itself."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self._start is not None:
            _synchronize()
            self.total_elapsed_time += time.perf_counter() - self._start
            self._start = None

    def avg_samples_per_sec(self) -> float:
        """``batch_size`` samples per timed step's seconds; ``-inf`` before the first step."""
        timed = self.global_step_count - self.start_step
        if self.global_step_count == 0 or timed <= 0 or self.total_elapsed_time == 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)
