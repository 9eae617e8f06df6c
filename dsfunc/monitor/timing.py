"""Forward time of each module over one step, for the FLOPs profile's latency column.

Hooks on the live module, installed for the profiled step only and removed after it; each synchronises the
device, so that step runs slower than the others (DeepSpeed's profiler does the same). Only forwards inside a
call of the model itself are timed: a checkpointed unit's forward recomputed in the backward is not a forward.
Modules inside a compiled forward or a replayed CUDA graph run no hooks and get no time.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn


class ModuleTimer:
    """Seconds each module's forward took (summed over the forwards while installed), by ``named_modules()`` path."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.forwards = 0  # calls of the model itself
        self._began: dict[str, list[float]] = defaultdict(list)
        self._depth = 0  # > 0 inside a call of the model itself
        self._handles = []
        for path, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._begin, path)))
            self._handles.append(module.register_forward_hook(functools.partial(self._end, path), always_call=True))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _begin(self, path: str, module: nn.Module, args: Any) -> None:
        if path == "":
            self._depth += 1
            self.forwards += 1
        if self._depth:
            self._began[path].append(self._now())

    def _end(self, path: str, module: nn.Module, args: Any, output: Any) -> None:
        if self._depth and self._began[path]:
            self.seconds[path] += self._now() - self._began[path].pop()
        if path == "" and self._depth:
            self._depth -= 1

    def remove(self) -> dict[str, float]:
        """Remove the hooks; the mean seconds per call of the model, by module path."""
        for handle in self._handles:
            handle.remove()
        return {path: s / self.forwards for path, s in self.seconds.items()} if self.forwards else {}
