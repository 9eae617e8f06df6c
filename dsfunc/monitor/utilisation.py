"""The progress line's ``tflops`` and ``mfu``: achieved TFLOP/s per device and model FLOPs utilisation.

The model's FLOPs per sample are counted once (:func:`~dsfunc.monitor.flops.count_flops`, on a meta copy) from
the first micro-batch the run shows (:meth:`Utilisation.see`), when the first line needs them; after that a
line costs two multiplications. ``tflops`` is model FLOPs (forward and backward, no recomputation) per second
per data-parallel rank over the same interval as ``CurrSamplesPerSec``; ``mfu`` divides it by the device's
peak (:mod:`dsfunc.monitor.peak`, or ``flops_profiler.peak_tflops``, or ``Monitor(peak_tflops=...)``), and is
left out where no peak is known (the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from dsfunc.config.dtypes import dtype_name
from dsfunc.monitor.flops import FlopCount, count_flops
from dsfunc.monitor.peak import device_name, peak_tflops


def _meta(t: Any) -> Any:
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t


class Utilisation:
    """Model FLOPs of a run (counted once) and the peak they are measured against.

    Args:
      state: the run's state (model skeleton, sharding plan, compute dtype, config).
      peak: the device's peak TFLOP/s; None: the config's ``flops_profiler.peak_tflops``, else the table's.
    """

    def __init__(self, state: Any, peak: float | None = None) -> None:
        program = state.program
        self.program = program
        self.micro_batch_size = program.config.train_micro_batch_size_per_gpu
        self.peak = peak or program.config.flops_profiler.peak_tflops
        self.peak_source = "given" if self.peak else "dsfunc's table"
        if self.peak is None:
            self.peak = peak_tflops(program.device, program.compute_dtype)
        self.count: FlopCount | None = None
        self.failure: str | None = None
        self._seen: tuple[Callable[[Any, Any], Any], Any] | None = None

    def see(self, run: Callable[[Any, Any], Any], micro_batch: Any) -> None:
        """Keep the shapes of a micro-batch and how the model runs on it (the first one only)."""
        if self._seen is None:
            self._seen = (run, optree.tree_map(_meta, micro_batch))

    @property
    def seen(self) -> bool:
        return self._seen is not None

    def counted(self) -> FlopCount | None:
        """The count, made now if a micro-batch was seen and it was not tried yet; None if it failed."""
        if self.count is None and self.failure is None and self._seen is not None:
            run, micro_batch = self._seen
            shapes = {a: p.shape for u in self.program.plan.units for p in u.params for a in p.aliases}
            try:
                self.count = count_flops(self.program.skeleton, run, micro_batch, samples=self.micro_batch_size,
                                         dtype=self.program.compute_dtype, shapes=shapes)
            except Exception as e:  # noqa: BLE001 (the model's own code on meta tensors may raise anything)
                self.failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return self.count

    def summary(self) -> str:
        """One line: what was counted and the peak, or why there are no FLOPs."""
        if self.count is None:
            return (f"[dsfunc] model FLOPs not counted, so no tflops/mfu: the model's forward failed on a meta "
                    f"copy ({self.failure})")
        c = self.count
        device = self.program.device
        dtype = dtype_name(self.program.compute_dtype)
        line = (f"[dsfunc] model FLOPs per sample: {c.per_sample:.4g} (forward {c.forward / c.samples:.4g} + "
                f"backward {c.backward / c.samples:.4g}, torch.utils.flop_counter on a meta copy); ")
        if self.peak is None:
            return line + (f"no peak FLOP/s known for {device_name(device)}: tflops without mfu "
                           '(set "flops_profiler": {"peak_tflops": ...} in the config)')
        return line + f"mfu against {self.peak:g} TFLOP/s per device ({device_name(device)}, {dtype}, {self.peak_source})"

    def line_parts(self, samples_per_sec_per_rank: float) -> list[str]:
        """``tflops=..`` and, with a peak, ``mfu=..%`` for a rate of samples per second per rank."""
        if self.count is None:
            return []
        tflops = self.count.per_sample * samples_per_sec_per_rank / 1e12
        parts = [f"tflops={tflops:.4g}"]
        if self.peak:
            parts.append(f"mfu={100 * tflops / self.peak:.2f}%")
        return parts
