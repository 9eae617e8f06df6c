"""The bf16 masters' update on the host, one unit at a time (ZeRO-Offload with ``bf16_master_weights_and_grads``).

The transform chain of :mod:`dsfunc.optim.low_precision` reads whole trees: run over every unit at once it widens
every gradient, moment and update to fp32 together, about 20 host bytes a parameter beside the 8 it keeps, the
largest share of host memory for a model of billions of parameters. Its arithmetic is element by element, and
everything it reads across units (the global norm, the step counts, the lr) is a step scalar, so
:func:`apply_by_unit` runs the same chain on one unit's slice of the state after another, through the update's
executor (a :class:`~dsfunc.optim.update.UnitWork`): the same numbers bit for bit, the fp32 temporaries of the
largest unit only, each unit's new 16-bit shard on its way to the device as it is done, the lazy units' in the
background, and the units' updates ahead of the step (``offload_optimizer.speculative_update``,
:mod:`dsfunc.zero.offload.speculation`) like the fused Adam's.

A leaf of the optimizer state belongs to a unit when it sits under the unit's name in a mapping keyed by units
(a moment, a Kahan compensation); the rest (step counts) are shared: each unit's update reads them as they were
before the step, and the step's new values come from the chain run over no unit at all. A chain whose every
optimizer works element by element (Adam, AdamW, SGD, Adagrad; rounding to nearest or Kahan's, whose bits do not
depend on an element's place) goes through a unit :data:`CHUNK` elements at a time: measured, one unit's update
otherwise holds 32 bytes an element of temporaries (48 with Kahan), 12 GB for a 5760-wide GPT block.

The common case, the config's Adam/AdamW with bf16 masters, moments and gradients rounding to nearest or with
Kahan's compensation (a :class:`NativeAdam`, which :func:`native_adam` alone decides), runs dsfunc's CPU kernel
instead (``dsfunc_cpu::adam_bf16_step_``, ``ops/adam_cpu.cpp``): the chain's numbers bit for bit, one pass over
each unit on the intra-op threads with no Python lock held, 30x faster than the torch ops on one thread. The
chain's torch ops stay for every other case, and where the kernel cannot be built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import optree
import torch

from dsfunc.frozen import FrozenDict
from dsfunc.kernels.adam import host_adam_bf16_step_
from dsfunc.kernels.native import native_ready
from dsfunc.optim.base import ByLabel, Transform, apply_updates
from dsfunc.optim.transforms import clip_coefficient

# the step's facts arrive as a dsfunc.optim.update.UpdateContext (not imported: that module runs this one)
UpdateContext = Any


CHUNK = 2**24  # elements an element-wise chain updates at a time: its fp32 temporaries (~32 bytes an element) 0.5 GB


@dataclasses.dataclass(frozen=True)
class NativeAdam:
    """The bf16 chain's case the CPU kernel runs: the config's Adam/AdamW, each parameter group's
    hyper-parameters (:class:`~dsfunc.optim.fused.AdamGroup`) and the unit -> group map (the chain's state
    follows that layout: ``state["optimizer"].inner`` is one group's ``{"adam", "weight_decay", "lr"}`` or
    ``{label: ...}``), with Kahan's compensation or rounding to nearest."""

    groups: Mapping[str | None, Any]
    unit_groups: Mapping[str, str | None]
    kahan: bool


def native_adam(adam: Any, rounding: str, states: bool) -> NativeAdam | None:
    """The native case of a bf16 chain whose optimizer is ``adam`` (a :class:`~dsfunc.optim.fused.FusedAdam`
    describing the config's Adam/AdamW, or None for any other optimizer), or None: stochastic rounding and fp32
    moments stay on the torch chain."""
    if adam is None or rounding not in ("nearest", "kahan") or not states:
        return None
    return NativeAdam(groups=dict(adam.groups), unit_groups=dict(adam.unit_groups), kahan=rounding == "kahan")


@dataclasses.dataclass(frozen=True)
class NativeStep:
    """A :class:`NativeAdam` at one step: per group its hyper-parameters, lr and fp32 step count (this step
    included), and the clip coefficient."""

    native: NativeAdam
    lrs: Mapping[str | None, torch.Tensor]
    steps: Mapping[str | None, torch.Tensor]
    clip: torch.Tensor


def _native_step(native: NativeAdam | None, max_norm: float | None, opt_state: Any, over_none: Any,
                 ctx: UpdateContext) -> NativeStep | None:
    """``native`` at this step (its lr as the chain's shared update computed it), or None where the kernel cannot
    run."""
    if native is None or max_norm is None or not native_ready("cpu"):
        return None
    before, after = opt_state["optimizer"].inner, over_none["optimizer"].inner
    lrs, steps = {}, {}
    for label in native.groups:
        old, new = (before, after) if label is None else (before[label], after[label])
        lrs[label] = new["lr"].lr.float()
        steps[label] = (old["adam"].count + 1).float()
    clip = clip_coefficient(ctx.grad_norm, max_norm) if max_norm > 0 else torch.ones(())
    return NativeStep(native=native, lrs=lrs, steps=steps, clip=clip.float())


def restrict(tree: Any, keep: frozenset[str] | set[str], units: frozenset[str]) -> Any:
    """``tree`` with each mapping keyed by ``units`` holding only the units of ``keep`` (the tensors themselves,
    not copies)."""
    if isinstance(tree, Mapping):
        keyed = bool(tree) and all(k in units for k in tree)
        return type(tree)({k: restrict(v, keep, units) for k, v in tree.items() if not keyed or k in keep})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(restrict(v, keep, units) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(restrict(v, keep, units) for v in tree)
    return tree


def _replace(tree: Any, values: Mapping[tuple, torch.Tensor]) -> Any:
    """``tree`` with the leaves at the paths of ``values`` replaced by them."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return optree.tree_unflatten(spec, [values.get(path, leaf) for path, leaf in zip(paths, leaves)])


def apply_by_unit(transform: Transform, max_norm: float | None, params: Mapping[str, torch.Tensor],
                  grads: Mapping[str, torch.Tensor], opt_state: Any, ctx: UpdateContext,
                  chunk: int = 0, native: NativeAdam | None = None) -> tuple[FrozenDict, Any]:
    """``transform``'s update of ``params`` and ``opt_state`` (in place, unit by unit through ``ctx.executor``), as
    :meth:`~dsfunc.optim.update.ChainUpdate.apply` over the whole tree would write it; ``max_norm``: the chain's
    clipping (None: unknown, so only the same global norm counts as the same step); ``chunk``: for an
    element-wise chain, the elements of a unit updated at a time (:data:`CHUNK`; 0: whole units); ``native``: the
    chain's case the CPU kernel runs (:func:`native_adam`), for the units whose tensors fit it. Returns the
    params and the state with its new shared leaves (the units' may still be written by the executor)."""
    units = frozenset(params)
    shared_paths, shared_leaves, _ = optree.tree_flatten_with_path(restrict(opt_state, frozenset(), units))
    before = {path: leaf.clone() for path, leaf in zip(shared_paths, shared_leaves)}  # as this step reads them
    _, over_none = transform.update({}, _replace(restrict(opt_state, frozenset(), units), before), {}, **extra(ctx))
    work = ChainUnitWork(transform=transform, params=params, grads=grads, opt_state=opt_state, units=units,
                         shared=before, ctx=ctx, key=_key(ctx, max_norm, before), chunk=chunk,
                         native=_native_step(native, max_norm, opt_state, over_none, ctx))
    new_paths, new_leaves, _ = optree.tree_flatten_with_path(over_none)
    new = {path: torch.where(ctx.finite, leaf, before[path]) for path, leaf in zip(new_paths, new_leaves)}
    ctx.executor.run(list(params), work)
    return FrozenDict(params), _replace(opt_state, new)


def extra(ctx: UpdateContext) -> dict[str, Any]:
    """What a chain's update reads of the step besides the gradients, state and params."""
    lr = ctx.lr
    if lr is not None:  # one group: its scale_by_learning_rate takes the value; several: multi_transform picks
        lr = lr[None] if None in lr else ByLabel(lr)
    return {"grad_scale": ctx.grad_scale, "global_norm": ctx.grad_norm, "segment_norm": ctx.segment_norm, "lr": lr}


def _key(ctx: UpdateContext, max_norm: float | None, shared: Mapping[tuple, torch.Tensor]) -> tuple:
    """The step scalars a unit's update is a function of: the unscale factor, the clip (the global norm itself when
    the chain's clipping is unknown), the finite flag and the shared state leaves."""
    if max_norm is None:
        clip = ctx.grad_norm
    else:
        clip = clip_coefficient(ctx.grad_norm, max_norm) if max_norm > 0 else torch.ones(())
    return (ctx.grad_scale, clip, ctx.finite, *shared.values())


@dataclasses.dataclass(frozen=True, eq=False)
class ChainUnitWork:
    """The chain's update of some units (a :class:`~dsfunc.optim.update.UnitWork`), each unit's state slice updated
    in place and its new compute copy written into ``ctx.lowp`` where there is one."""

    transform: Transform
    params: Mapping[str, torch.Tensor]
    grads: Mapping[str, torch.Tensor]
    opt_state: Any
    units: frozenset[str]
    shared: Mapping[tuple, torch.Tensor]  # path -> the shared leaf as the step reads it
    ctx: UpdateContext
    key: tuple
    chunk: int = 0  # elements of a unit updated at a time (element-wise chains; 0: the whole unit)
    native: NativeStep | None = None  # the CPU kernel's case, for the units whose tensors fit it

    def view(self, name: str) -> Any:
        """The state as unit ``name``'s update reads it: its own leaves, and the shared ones of before the step."""
        return _replace(restrict(self.opt_state, {name}, self.units), self.shared)

    def __call__(self, names: list[str]) -> None:
        for name in names:
            if not self._native(name):
                self._chain(name)
            lowp = self.ctx.lowp.get(name)
            if lowp is not None:
                lowp.copy_(self.params[name])
            self.ctx.executor.unit_done(name, self.params[name])

    def _chain(self, name: str, out: list[torch.Tensor] | None = None) -> None:
        """Unit ``name``'s update by the chain's torch ops, written into its own tensors or ``out``."""
        finite = self.ctx.finite
        state, master, grad = self.view(name), self.params[name], self.grads[name]
        own = _own(state, state, self.shared)
        dests = out if out is not None else self.writes(name)
        step = master.numel()
        if self.chunk and master.dim() == 1 and all(t.shape == master.shape for _, t, _ in own):
            step = self.chunk  # an element-wise chain: a slice of the unit at a time, the same numbers
        for start in range(0, max(master.numel(), 1), max(step, 1)):
            part = slice(start, start + step)
            sliced = _replace(state, {path: t[part] for path, t, _ in own})
            # the gradient read before the compute copy is written (it may be written over it)
            updates, new = self.transform.update({name: grad[part].float()}, sliced, {name: master[part]},
                                                 **extra(self.ctx))
            torch.where(finite, apply_updates({name: master[part]}, updates)[name], master[part],
                        out=dests[0][part])
            for (_, old, value), dest in zip(_own(sliced, new, self.shared), dests[1:], strict=True):
                torch.where(finite, value, old, out=dest[part])

    def _native(self, name: str, out: list[torch.Tensor] | None = None) -> bool:
        """Unit ``name``'s update by the CPU kernel, where its tensors are what the kernel takes (False: not run),
        written into them or ``out``."""
        if self.native is None:
            return False
        native, label = self.native.native, self.native.native.unit_groups.get(name)
        if label not in native.groups:
            return False
        inner = self.opt_state["optimizer"]
        adam = (inner.inner if label is None else inner.inner[label])["adam"]
        master, grad, mu, nu = self.params[name], self.grads[name], adam.mu[name], adam.nu[name]
        compensation = inner.compensation.get(name) if native.kahan else None
        low = [master, mu, nu] + ([compensation] if native.kahan else [])
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and _flat(t, master) for t in low):
            return False
        if grad.dtype not in (torch.bfloat16, torch.float32) or not _flat(grad, master):
            return False
        written = low
        if out is not None:  # the same tensors as writes(), in its order
            into = {id(t): o for t, o in zip(self.writes(name), out, strict=True)}
            if len(into) != len(low) or any(id(t) not in into for t in low):
                return False
            written = [into[id(t)] for t in low]
        group = native.groups[label]
        host_adam_bf16_step_(written[0], grad, written[1], written[2], written[3] if native.kahan else None,
                             self.ctx.grad_scale.float(), self.native.clip, self.native.lrs[label],
                             self.native.steps[label], self.ctx.skip, group.beta1, group.beta2, group.eps,
                             group.weight_decay, group.adam_w_mode, group.bias_correction,
                             sources=() if out is None else low)
        return True

    def writes(self, name: str) -> list[torch.Tensor]:
        state = self.view(name)
        return [self.params[name], *(old for _, old, _ in _own(state, state, self.shared))]

    def ahead(self, name: str, out: list[torch.Tensor]) -> None:
        if not self._native(name, out):
            self._chain(name, out)

    def same(self, other: object, name: str) -> bool:
        if not isinstance(other, ChainUnitWork) or other.transform is not self.transform:
            return False
        if any(a is not b for a, b in zip(self.writes(name), other.writes(name), strict=True)):
            return False
        if self.ctx.lr != other.ctx.lr or len(self.key) != len(other.key):
            return False
        return all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.key, other.key, strict=True))


def _flat(t: torch.Tensor, like: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous() and t.numel() == like.numel()


def _own(state: Any, new: Any, shared: Mapping[tuple, torch.Tensor]) -> list[tuple[tuple, torch.Tensor, Any]]:
    """(path, old leaf, new leaf) of the unit's own tensors in a unit's view ``state`` and its update ``new``."""
    paths, olds, spec = optree.tree_flatten_with_path(state)
    news = spec.flatten_up_to(new)
    return [(p, o, n) for p, o, n in zip(paths, olds, news) if p not in shared and isinstance(o, torch.Tensor)]

