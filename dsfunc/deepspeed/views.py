"""What :func:`~dsfunc.deepspeed.initialize` returns as ``optimizer`` and ``lr_scheduler``: views of the
engine's update, so scripts that read ``param_groups`` or ``get_last_lr()`` keep working."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optree
import torch

from dsfunc.errors import InputError, UsageError
from dsfunc.optim.base import ScheduleState, current_lr

if TYPE_CHECKING:
    from dsfunc.deepspeed.engine import Engine


def schedule_count(opt_state: Any) -> torch.Tensor:
    """Applied steps so far, from the learning-rate state of the update."""
    for node in optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleState)):
        if isinstance(node, ScheduleState):
            return node.count
    raise InputError("the optimizer state holds no learning-rate state")


def plain(value: Any) -> Any:
    """Python numbers and lists for tensors and tuples (what a torch optimizer's param_groups hold)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value


class EngineOptimizer:
    """What :func:`initialize` returns as ``optimizer``: a view of the engine's update.

    ``param_groups[0]`` has the config's hyper-parameters with the current ``lr``; ``zero_grad()`` does
    nothing; stepping or saving it is an error that points to the engine.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        cfg = self._engine.config.optimizer
        return [{**{k: plain(v) for k, v in cfg.params.items()}, "lr": self._engine.get_lr()[0]}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients never live on the module's parameters."""

    def step(self, closure: Any = None) -> None:
        raise UsageError("call engine.step() (after engine.backward(loss)); it applies the update")

    def state_dict(self) -> dict[str, Any]:
        raise UsageError("the optimizer state is engine.state.opt_state; save it with engine.save_checkpoint")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise UsageError("restore the optimizer state with engine.load_checkpoint")


class EngineLRScheduler:
    """What :func:`initialize` returns as ``lr_scheduler``: a view of the engine's lr schedule.

    The engine advances it in ``engine.step()`` (not on skipped steps); calling ``step()`` here is an error.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: applied optimizer steps - 1."""
        return int(schedule_count(self._engine.state.opt_state)) - 1

    def get_lr(self) -> list[float]:
        """The lr the next optimizer step uses."""
        return self._engine.get_lr()

    def get_last_lr(self) -> list[float]:
        """The lr the last applied optimizer step used."""
        if self.last_batch_iteration < 0:
            raise UsageError("need to call step() first: no optimizer step has been applied yet")
        return [float(current_lr(self._engine.state.opt_state))]

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError("the engine advances the lr schedule in engine.step(); remove lr_scheduler.step()")

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}
