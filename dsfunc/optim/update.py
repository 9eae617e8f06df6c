"""Applying an update to a state's flat shards: the general path, for any update transform.

An *update* (what :func:`dsfunc.init_state` keeps in the program) has ``init(params)`` and
``apply(params, grads, opt_state, ctx) -> (params, opt_state)``, with the step's facts in an
:class:`UpdateContext`. :class:`ChainUpdate` runs an optax-style
transform and commits its result only where the step is finite (no host sync); the fused Adam of
:mod:`dsfunc.optim.fused` is the other kind, and writes the compute copy as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import optree
import torch

from dsfunc.frozen import FrozenDict
from dsfunc.optim.base import Transform, apply_updates
from dsfunc.optim.low_precision_host import NativeAdam, apply_by_unit, extra


class UnitWork(Protocol):
    """An update's work over units, which an executor may run now, later, or unit by unit ahead of the step."""

    def __call__(self, names: list[str]) -> None:
        """Update the named units in place, telling the executor after each (:meth:`UnitExecutor.unit_done`)."""
        ...

    def writes(self, name: str) -> list[torch.Tensor]:
        """The tensors the update of unit ``name`` writes in place, its master first."""
        ...

    def ahead(self, name: str, out: list[torch.Tensor]) -> None:
        """Unit ``name``'s update reading :meth:`writes`, which it leaves as they are, and writing ``out`` (tensors
        like them, in that order) instead; no compute copy, no :meth:`UnitExecutor.unit_done` (an update run
        ahead of its step, which stands by exchanging ``out`` with :meth:`writes`)."""
        ...

    def same(self, other: UnitWork, name: str) -> bool:
        """Whether ``other`` writes unit ``name`` bit for bit what this does from the same gradient: the same
        tensors, hyper-parameters and step scalars (a speculative update stands only then)."""
        ...


class UnitExecutor(Protocol):
    """Runs an update's work over units: now, or (ZeRO-Offload at stage 3) partly in the background."""

    on_host: bool  # the update runs on the host: every tensor of its context is in host memory

    def run(self, names: list[str], work: UnitWork) -> None:
        """Run ``work(names)``, now or later; ``work`` calls :meth:`unit_done` after each unit."""
        ...

    def unit_done(self, name: str, master: torch.Tensor) -> None:
        """Unit ``name``'s new ``master`` is final (its copy to the device may start)."""
        ...


class RunNow:
    """Work runs at once, on the device; nothing needs telling when a unit is done."""

    on_host = False

    def run(self, names: list[str], work: UnitWork) -> None:
        work(names)

    def unit_done(self, name: str, master: torch.Tensor) -> None:
        """Nothing waits for single units."""


RUN_NOW = RunNow()


@dataclasses.dataclass(frozen=True)
class UpdateContext:
    """What an update needs to know about the step besides the gradients."""

    loss_scale: torch.Tensor  # the grads are still multiplied by it
    grad_norm: torch.Tensor  # global, unscaled, before clipping
    grad_scale: torch.Tensor  # 1 / (loss scale * the clip coefficient at the update's clip_norm): unscales and clips
    finite: torch.Tensor  # 0-d bool: False skips the update (nothing changes)
    skip: torch.Tensor  # 0-d bool: ~finite, made once for the step
    lowp: Mapping[str, torch.Tensor]  # where the update may write the new 16-bit compute copy
    segment_norm: Callable[[Any], Any] | None  # per-parameter norms over flat shards (Lamb)
    # Who runs the update's work over units, now or in the background, told as each unit is done
    # (dsfunc.zero.policy.UpdateRunner makes it).
    executor: UnitExecutor = RUN_NOW
    # The lr of this step per parameter group (label; None: the only group), replacing the group's constant
    # or scheduled lr: a client that set its optimizer's param_groups lr (DeepSpeed steps with it).
    lr: Mapping[str | None, float] | None = None


@dataclasses.dataclass(frozen=True)
class ChainUpdate:
    """An update transform over the state's shards, whose grads arrive multiplied by the loss scale."""

    transform: Transform
    # on the host, run unit by unit through the executor (dsfunc.optim.low_precision_host): the config's chain for
    # bf16 masters, whose arithmetic is element by element; ``max_norm`` is its clipping
    by_unit: bool = False
    max_norm: float | None = None
    chunk: int = 0  # element-wise chains: elements of a unit updated at a time on the host (0: whole units)
    native: NativeAdam | None = None  # the chain's case dsfunc's CPU kernel runs on the host (native_adam)
    clip_norm = 0.0  # ctx.grad_scale only unscales: the transform clips (or not) itself
    writes_compute_copy = False  # the workspace rebuilds the compute copies from the new masters
    reads_16_bit_grads = False  # the transform reads fp32 trees: 16-bit gradients would be widened all at once

    def init(self, params: Mapping[str, torch.Tensor]) -> Any:
        return self.transform.init(dict(params))

    def apply(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], opt_state: Any,
              ctx: UpdateContext) -> tuple[FrozenDict, Any]:
        """New params and optimizer state, written into the old buffers (unchanged where not finite)."""
        if self.by_unit and ctx.executor.on_host:
            return apply_by_unit(self.transform, self.max_norm, params, grads, opt_state, ctx, self.chunk,
                                 self.native)
        grads = {name: g.float() for name, g in grads.items()}  # offloaded host gradients may be 16-bit
        updates, new_opt_state = self.transform.update(grads, opt_state, dict(params), **extra(ctx))
        new_params = apply_updates(dict(params), updates)

        def commit(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return torch.where(ctx.finite, new, old, out=old)

        params = FrozenDict({k: commit(params[k], new_params[k]) for k in params})
        return params, optree.tree_map(commit, opt_state, new_opt_state)
