"""A client's own ``torch.optim.Optimizer`` as the update: its ``step()`` runs on the state's fp32 shards.

DeepSpeed accepts any optimizer class: without ZeRO it steps it on the parameters, with ZeRO on flat fp32
partitions of each parameter group (``zero_allow_untested_optimizer``). dsfunc does the latter at every
stage: each unit's master shard is a parameter of a shallow copy of the client's optimizer (its class, its
``param_groups`` options, its hooks), whose ``.grad`` is the unit's unscaled and clipped gradient. For an
element-wise rule that is DeepSpeed's update bit for bit, whatever the sharding.

The optimizer's per-tensor state lives in the :class:`~dsfunc.TrainState` (checkpointed, resharded with the
shards), not in the optimizer: each step loads it into the copy and takes it out again. A torch optimizer
makes its state on its first step, so the state's layout is found at ``init`` by stepping a throwaway copy,
and the first real step starts from an empty state as the optimizer expects (reading the step count is one
host sync per step). Overflowing steps change nothing (the new values are committed where the step is finite).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from dsfunc.errors import InputError
from dsfunc.frozen import FrozenDict
from dsfunc.optim.transforms import ScheduleState
from dsfunc.schedules import Schedule


class TorchOptimizerState(NamedTuple):
    """Applied steps and the lr used, per parameter group, and each unit's optimizer state entries."""

    schedules: tuple[ScheduleState, ...]
    per_unit: dict[str, dict[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class TorchOptimizerUpdate:
    """An update (see :mod:`dsfunc.optim.update`) that runs ``optimizer.step()`` on the state's shards.

    ``unit_groups`` maps each unit to the index of its group in ``optimizer.param_groups``; ``schedules`` gives
    each group's lr schedule (None: the group's own lr); ``clip_norm`` is the config's gradient clipping.
    """

    optimizer: torch.optim.Optimizer
    unit_groups: Mapping[str, int]
    schedules: tuple[Schedule | None, ...]
    clip_norm: float = 0.0
    writes_compute_copy = False
    reads_16_bit_grads = False

    def _lr_at(self, group: int, count: torch.Tensor) -> torch.Tensor:
        schedule = self.schedules[group]
        if schedule is None:
            return torch.full((), float(self.optimizer.param_groups[group]["lr"]), dtype=torch.float32,
                              device=count.device)
        return schedule(count - 1).to(torch.float32)

    def _copy(self, params: Mapping[str, torch.Tensor]) -> torch.optim.Optimizer:
        """A shallow copy of the client's optimizer over ``params`` (unit name -> tensor), grouped as the units."""
        opt = copy.copy(self.optimizer)
        opt.param_groups = [{**g, "params": [params[k] for k, i in self.unit_groups.items() if i == gi and k in params]}
                            for gi, g in enumerate(self.optimizer.param_groups)]
        opt.state = defaultdict(dict)
        return opt

    def init(self, params: Mapping[str, torch.Tensor]) -> TorchOptimizerState:
        """Zeros shaped as the optimizer's state after one step (found on a throwaway copy), to be filled by the
        first real step."""
        probe = {k: v.detach().clone() for k, v in params.items()}
        for t in probe.values():
            t.grad = torch.zeros_like(t)
        opt = self._copy(probe)
        with torch.no_grad():
            opt.step()
        per_unit = {}
        for k, t in probe.items():
            entries = {}
            for key, value in opt.state.get(t, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise InputError(
                        f"the client {type(self.optimizer).__qualname__} keeps a {type(value).__name__} as "
                        f"state[{key!r}]; dsfunc keeps an optimizer's state as tensors: store it as a tensor"
                    )
                entries[key] = torch.zeros_like(value)
            per_unit[k] = entries
        device = next(iter(params.values())).device if params else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int64, device=device)
        schedules = tuple(ScheduleState(count.clone(), self._lr_at(i, count))
                          for i in range(len(self.optimizer.param_groups)))
        return TorchOptimizerState(schedules, per_unit)

    def apply(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
              opt_state: TorchOptimizerState, ctx: Any) -> tuple[FrozenDict, TorchOptimizerState]:
        """New params and optimizer state, written into the old buffers (unchanged where the step overflowed)."""
        work = {k: p.detach().clone() for k, p in params.items()}
        for k, t in work.items():
            t.grad = grads[k].float() * ctx.grad_scale
        opt = self._copy(work)
        started = bool(int(opt_state.schedules[0].count) > 0) if opt_state.schedules else False
        if started:
            for k, t in work.items():
                opt.state[t] = {key: v.clone() for key, v in opt_state.per_unit[k].items()}
        lrs = []
        for i, (group, sched) in enumerate(zip(opt.param_groups, opt_state.schedules)):
            given = None if ctx.lr is None else ctx.lr.get(None if len(opt.param_groups) == 1 else f"group{i}")
            lr = torch.full((), float(given), dtype=torch.float32, device=sched.count.device) \
                if given is not None else self._lr_at(i, sched.count)
            group["lr"] = float(lr)
            lrs.append(lr)
        with torch.no_grad():
            opt.step()

        def commit(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return torch.where(ctx.finite, new.to(old.dtype), old, out=old)

        new_params = FrozenDict({k: commit(params[k], work[k]) for k in params})
        per_unit = {k: {key: commit(v, opt.state[work[k]][key]) for key, v in entries.items()}
                    for k, entries in opt_state.per_unit.items()}
        schedules = tuple(ScheduleState(torch.where(ctx.finite, s.count + 1, s.count),
                                        torch.where(ctx.finite, lr, s.lr)) for s, lr in zip(opt_state.schedules, lrs))
        return new_params, TorchOptimizerState(schedules, per_unit)
