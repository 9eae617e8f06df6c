"""``deepspeed.runtime.zero.stage_1_and_2`` and ``deepspeed.runtime.zero.stage3``: the classes of the optimizer
:func:`~dsfunc.deepspeed.initialize` returns under ZeRO, so scripts that check ``isinstance(engine.optimizer,
DeepSpeedZeroOptimizer)`` and read its fp32 partitions keep working. Both are the engine's optimizer view
(:class:`~dsfunc.deepspeed.views.EngineOptimizer`) under DeepSpeed's names, with DeepSpeed's name for this
rank's fp32 masters; the values are read from the state when asked (nothing is kept)."""

from __future__ import annotations

from typing import Any

import torch

from dsfunc.deepspeed.namespace import other_name
from dsfunc.deepspeed.views import EngineOptimizer, Viewed


class DeepSpeedZeroOptimizer(EngineOptimizer):
    """The engine's optimizer at ZeRO stages 1 and 2."""

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """This rank's fp32 master partition of each parameter group, flat."""
        return self.fp32_partitions()


class DeepSpeedZeroOptimizer_Stage3(EngineOptimizer):
    """The engine's optimizer at ZeRO stage 3."""

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """This rank's fp32 master partition of each parameter group, flat."""
        return self.fp32_partitions()


def engine_optimizer(engine: Viewed, param_groups: list[dict[str, Any]] | None) -> EngineOptimizer:
    """The optimizer view of ``engine``, of the class DeepSpeed's engine returns at its ZeRO stage (stage 0: the
    plain view, as DeepSpeed's optimizer there is none of its ZeRO classes)."""
    stage = engine.state.program.plan.stage
    kind = {0: EngineOptimizer, 3: DeepSpeedZeroOptimizer_Stage3}.get(stage, DeepSpeedZeroOptimizer)
    return kind(engine, param_groups)


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of its ZeRO optimizer modules import, and refuse when used."""
    return other_name("runtime.zero", name)
