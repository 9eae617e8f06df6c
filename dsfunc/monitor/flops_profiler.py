"""DeepSpeed's ``deepspeed.profiling.flops_profiler`` API on ``torch.utils.flop_counter``: :func:`get_model_profile`
and :class:`FlopsProfiler`, which count the forwards a script runs on the real model (latency measured around
them) and print the same profile as the config's ``flops_profiler`` section (:mod:`dsfunc.monitor.profile`).

FLOPs are those ``FlopCounterMode`` counts (matrix products, convolutions, attention; MACs are half of them).
DeepSpeed's profiler also counts elementwise work (activations, norms, softmax), so it reports somewhat more
FLOPs for the same model; for Linear-heavy models the two agree to within a few percent.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dsfunc.errors import InputError, UsageError
from dsfunc.monitor.flops import FlopCount, flop_count, flop_counter
from dsfunc.monitor.profile import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    profile_text,
)

__all__ = ["FlopsProfiler", "duration_to_string", "flops_to_string", "get_model_profile", "macs_to_string",
           "number_to_string", "params_to_string"]


def _sync(model: nn.Module) -> None:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FlopsProfiler:
    """Counts the model's forwards between :meth:`start_profile` and :meth:`stop_profile` (DeepSpeed's class).

    Args:
      model: the module profiled.
      ds_engine: the engine (its world size goes into the printed profile), or None.
      recompute_fwd_factor: forwards recomputed in the backward (for the printed FLOP/s).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._counting = False  # inside the counter (between start_profile and stop_profile)
        self._duration = 0.0
        self._began = 0.0
        self._handles: list[Any] = []

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Count from now on (``ignore_list`` is not supported: every module counts)."""
        if ignore_list:
            raise InputError("FlopsProfiler.start_profile(ignore_list=...): dsfunc counts every module; pass None")
        self.reset_profile()
        self._counter = flop_counter()
        self._counter.__enter__()
        self._counting = True
        self._handles = [self.model.register_forward_pre_hook(lambda *_: self._begin()),
                         self.model.register_forward_hook(lambda *_: self._end())]
        self.started = True

    def _begin(self) -> None:
        _sync(self.model)
        self._began = time.perf_counter()

    def _end(self) -> None:
        _sync(self.model)
        self._duration += time.perf_counter() - self._began

    def stop_profile(self) -> None:
        """Stop counting (the counts stay readable until :meth:`end_profile`)."""
        if self._counting:
            self._counting = False
            self._counter.__exit__(None, None, None)
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def reset_profile(self) -> None:
        self._duration = 0.0

    def end_profile(self) -> None:
        """Stop and drop the counts."""
        self.stop_profile()
        self.started = False
        self._counter = None

    def _count(self) -> FlopCount:
        if self._counter is None:
            raise UsageError("FlopsProfiler: call start_profile() and run the model first")
        return flop_count(self.model, self._counter, 0, 1)

    def get_total_flops(self, as_string: bool = False) -> Any:
        flops = self._count().forward
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> Any:
        macs = self._count().forward // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> Any:
        params = sum(p.numel() for p in self.model.parameters())
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> Any:
        return duration_to_string(self._duration) if as_string else self._duration

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Print the profile of what was counted (to ``output_file`` when given)."""
        if not self.started:
            return
        world = getattr(self.ds_engine, "world_size", 1) if self.ds_engine is not None else 1
        text = profile_text(self._count(), step=profile_step, module_depth=module_depth, top_modules=top_modules,
                            detailed=detailed, world_size=world, recompute_fwd_factor=self.recompute_fwd_factor,
                            latency={"forward": self._duration} if self._duration else None,
                            counted="over the forwards run while profiling")
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            print(text, file=sys.stdout, flush=True)


def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None, args: Sequence[Any] = (),
                      kwargs: dict[str, Any] | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """FLOPs, MACs and parameters of one forward of ``model`` (DeepSpeed's function, same arguments).

    The model runs in eval mode, under ``torch.no_grad()``, ``warm_up`` times and then once counted; ``input_shape``
    makes one input of that shape (the parameters' dtype and device), else ``args``/``kwargs`` are the inputs.
    ``mode="generate"`` profiles ``model.generate``. Returns strings (``"1.23 G"``) unless ``as_string=False``.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise InputError(f'get_model_profile: mode must be "forward" or "generate", got {mode!r}')
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise InputError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        args = [torch.ones(input_shape, dtype=first.dtype if first is not None else None,
                           device=first.device if first is not None else None)]
    if not args and not kwargs:
        raise InputError("get_model_profile: give input_shape, or the model's inputs as args and/or kwargs")
    call = model.generate if mode == "generate" else model
    model.eval()
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            call(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            call(*args, **kwargs)
        finally:
            profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    profiler.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
