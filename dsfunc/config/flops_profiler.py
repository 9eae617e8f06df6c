"""The ``flops_profiler`` section: DeepSpeed's FLOPs profile of one step (:mod:`dsfunc.monitor.profile`),
with DeepSpeed 0.19.8's keys and defaults, and ``peak_tflops``, the device peak MFU is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from dsfunc.config.checks import _bool, _integer, _number, _optional, _string
from dsfunc.config.schema import _key


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """``flops_profiler``: print a per-module table of the model's FLOPs once, on rank 0."""

    enabled: bool = _key(False, _bool)
    """Print the profile of the step that starts after ``profile_step`` optimizer steps."""
    profile_step: int = _key(1, _integer(ge=0))
    """Optimizer steps before the profiled one (warm-up for its latency), as DeepSpeed counts them."""
    module_depth: int = _key(-1, _integer(ge=-1))
    """How deep into the module tree the table goes; -1: every module."""
    top_modules: int = _key(1, _integer(ge=1))
    """How many modules the per-depth ranking (by parameters and by FLOPs) names."""
    detailed: bool = _key(True, _bool)
    """Print the per-module table (false: the summary and the ranking only)."""
    output_file: str | None = _key(None, _optional(_string))
    """Write the profile to this file instead of stdout (its directory is created)."""
    recompute_fwd_factor: float = _key(0.0, _number(ge=0.0))
    """Forward passes recomputed in the backward (activation checkpointing: 1.0 for full recomputation),
    added to the counted FLOPs in the profile's FLOP/s. The progress line's MFU counts model FLOPs, without
    recomputation, as MFU is defined.
    """
    peak_tflops: float | None = _key(None, _optional(_number(gt=0.0)))
    """A dsfunc key, read whether or not the profiler is enabled: the peak TFLOP/s of one device that the
    progress line's MFU divides by. null: the device's dense 16-bit (or fp32) peak from dsfunc's table of
    known GPUs; on the CPU and unknown devices the line shows tflops without mfu.
    """
