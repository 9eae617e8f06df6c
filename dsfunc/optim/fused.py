"""The fast update path: the config's Adam/AdamW applied in place by dsfunc's fused op.

When the optimizer comes from the config and is Adam or AdamW (without OneCycle's cycled momentum),
the step does not run the transform chain. Instead, per parameter group, one ``dsfunc::adam_steps_`` call
unscales and clips each unit's gradient, skips on overflow, updates the moments and the fp32 master in place, and
writes the compute-dtype copy that the next all-gather sends: one pass over memory. On CUDA that is the
kernel in ``ops/``; elsewhere the op's plain-torch reference runs (the same math as the chain
``scale_by_factor -> clip_by_global_norm -> adam``, up to the unscale and clip factors being multiplied
once instead of twice). Its state is the equivalent chain's (:meth:`FusedAdam.init`), so checkpoints and
the chain read it unchanged. With parameter groups each unit belongs to one group (the plan splits
units by group), and the op takes that group's hyper-parameters and lr. Where the update runs on the host
(``ctx.executor.on_host``: ZeRO-Offload) the units are updated by the op's CPU kernel
(:mod:`dsfunc.optim.host_adam`), with the same element arithmetic as the CUDA kernel's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dsfunc import kernels
from dsfunc.config import OptimizerConfig
from dsfunc.frozen import FrozenDict
from dsfunc.kernels.adam import host_adam_step_
from dsfunc.optim.base import Transform
from dsfunc.optim.host_adam import host_adam_
from dsfunc.optim.update import UpdateContext

Schedule = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class AdamGroup:
    """One parameter group's Adam/AdamW hyper-parameters and lr schedule."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction: bool
    lr: float
    schedule: Schedule | None

    @classmethod
    def from_section(cls, section: OptimizerConfig, schedule: Schedule | None) -> AdamGroup:
        p = section.params
        beta1, beta2 = p["betas"]
        return cls(beta1=float(beta1), beta2=float(beta2), eps=float(p["eps"]),
                   weight_decay=float(p["weight_decay"]),
                   adam_w_mode=section.type == "adamw" or bool(p["adam_w_mode"]),
                   bias_correction=bool(p["bias_correction"]), lr=float(p["lr"]), schedule=schedule)


@dataclasses.dataclass(frozen=True)
class FusedAdam:
    """The config's Adam/AdamW: each parameter group's hyper-parameters and lr schedule, the unit -> group
    map, and the chain whose state it keeps. Without groups the one group is ``None`` and the state is the
    plain chain's; with groups it is :func:`~dsfunc.optim.base.multi_transform`'s, ``{label: chain}``."""

    groups: Mapping[str | None, AdamGroup]
    unit_groups: Mapping[str, str | None]
    clip_norm: float  # the step's ctx.grad_scale clips at it (dsfunc.kernels.step_scalars)
    chain: Transform  # unscale -> clip -> adam (per group): the same math, and the layout of the state
    # (label, device) -> a constant lr as a 0-d tensor, made once rather than filled every step
    _constant_lrs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    writes_compute_copy = True  # the update writes this rank's slice of the 16-bit compute copy
    reads_16_bit_grads = True  # the op reads a 16-bit gradient as it is, widening element by element

    @classmethod
    def from_sections(cls, sections: Mapping[str | None, OptimizerConfig],
                      schedules: Mapping[str | None, Schedule | None], unit_groups: Mapping[str, str | None],
                      max_norm: float, chain: Transform) -> FusedAdam | None:
        """The fused update for these groups' optimizer sections, or None when one is not plain Adam/AdamW."""
        if any(section.type not in ("adam", "adamw") for section in sections.values()):
            return None
        groups = {label: AdamGroup.from_section(section, schedules[label]) for label, section in sections.items()}
        return cls(groups=groups, unit_groups=unit_groups, clip_norm=float(max_norm), chain=chain)

    def init(self, params: Mapping[str, torch.Tensor]) -> Any:
        return self.chain.init(dict(params))

    def apply(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], opt_state: Any,
              ctx: UpdateContext) -> tuple[FrozenDict, Any]:
        """Update ``params``, the moments and ``ctx.lowp`` in place; return them with the new counters."""
        finite, skip, grad_scale, device = ctx.finite, ctx.skip, ctx.grad_scale, ctx.loss_scale.device
        states = opt_state["optimizer"]
        new_states = {}
        for label, group in self.groups.items():
            chain = states if label is None else states[label]
            adam, sched = chain["adam"], chain["lr"]
            given = None if ctx.lr is None else ctx.lr.get(label)
            if given is not None:
                lr = torch.full((), float(given), dtype=torch.float32, device=device)
            elif group.schedule is None:
                key = (label, device)
                lr = self._constant_lrs.get(key)
                if lr is None:
                    lr = self._constant_lrs[key] = torch.full((), group.lr, dtype=torch.float32,
                                                              device=device)
            else:
                lr = group.schedule(sched.count - 1).to(torch.float32)
            # count + 1 written as float32 by the add itself: one op, not an add and a cast
            step = torch.add(adam.count, 1, out=torch.empty((), dtype=torch.float32, device=adam.count.device))
            names = [n for n in params if self.unit_groups.get(n) == label]
            if ctx.executor.on_host:
                ctx.executor.run(names, HostAdamWork(params=params, grads=grads, adam=adam, ctx=ctx, group=group,
                                                     lr=lr, step=step, grad_scale=grad_scale, skip=skip))
            else:  # one call for the group's units with a 16-bit copy to write, one for those without
                for lowp in (True, False):
                    part = [n for n in names if (n in ctx.lowp) is lowp]
                    if part:
                        kernels.adam_steps_(
                            [params[n] for n in part], [grads[n] for n in part], [adam.mu[n] for n in part],
                            [adam.nu[n] for n in part], lowps=[ctx.lowp[n] for n in part] if lowp else (),
                            grad_scale=grad_scale, lr=lr, step=step, skip=skip, beta1=group.beta1,
                            beta2=group.beta2, eps=group.eps, weight_decay=group.weight_decay,
                            adam_w_mode=group.adam_w_mode, bias_correction=group.bias_correction,
                        )
            new_states[label] = {  # the counts advance by the bool flag itself (promoted in the add: no cast)
                **chain,
                "adam": adam._replace(count=adam.count + finite),
                "lr": sched._replace(count=sched.count + finite, lr=torch.where(finite, lr, sched.lr)),
            }
        optimizer = new_states.get(None, new_states)
        return FrozenDict(params), {**opt_state, "optimizer": optimizer}


@dataclasses.dataclass(frozen=True, eq=False)
class HostAdamWork:
    """The host Adam of one parameter group's units (a :class:`~dsfunc.optim.update.UnitWork`), each unit's new
    compute copy written with it. Its step scalars are fields, so that an update run ahead of the step under
    assumed scalars can be checked against the step's own (:meth:`same`)."""

    params: Mapping[str, torch.Tensor]
    grads: Mapping[str, torch.Tensor]
    adam: Any
    ctx: UpdateContext
    group: AdamGroup
    lr: torch.Tensor
    step: torch.Tensor
    grad_scale: torch.Tensor
    skip: torch.Tensor

    def __call__(self, names: list[str]) -> None:
        group, params = self.group, self.params
        host_adam_(
            [params[n] for n in names], _JustInTime(self.grads, names), [self.adam.mu[n] for n in names],
            [self.adam.nu[n] for n in names], grad_scale=self.grad_scale, lr=self.lr, step=self.step, skip=self.skip,
            beta1=group.beta1, beta2=group.beta2, eps=group.eps, weight_decay=group.weight_decay,
            adam_w_mode=group.adam_w_mode, bias_correction=group.bias_correction,
            lowp=_JustInTime(self.ctx.lowp, names),
            done=lambda i: self.ctx.executor.unit_done(names[i], params[names[i]]),
        )

    def writes(self, name: str) -> list[torch.Tensor]:
        return [self.params[name], self.adam.mu[name], self.adam.nu[name]]

    def ahead(self, name: str, out: list[torch.Tensor]) -> None:
        group, (param, mu, nu) = self.group, out
        host_adam_step_(param, self.grads[name], mu, nu, None, self.grad_scale, self.lr, self.step, self.skip,
                        group.beta1, group.beta2, group.eps, group.weight_decay, group.adam_w_mode,
                        group.bias_correction, sources=self.writes(name))

    def same(self, other: object, name: str) -> bool:
        if not isinstance(other, HostAdamWork) or other.group != self.group:
            return False
        if any(a is not b for a, b in zip(self.writes(name), other.writes(name), strict=True)):
            return False
        mine = (self.lr, self.step, self.grad_scale, self.skip)
        theirs = (other.lr, other.step, other.grad_scale, other.skip)
        return all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(mine, theirs, strict=True))


class _JustInTime(Sequence):
    """``values[names[i]]`` (or None), read when the host Adam reaches unit i: a runner may hand the update
    mappings whose values are a few buffers reused in turn (:mod:`dsfunc.zero.offload`), taken one unit at a time."""

    def __init__(self, values: Mapping[str, torch.Tensor], names: list[str]) -> None:
        self._values, self._names = values, names

    def __getitem__(self, i: int) -> torch.Tensor | None:
        return self._values.get(self._names[i])

    def __len__(self) -> int:
        return len(self._names)
