"""ZeRO data parallelism: the layout of the parameters over ranks, and the micro-batch runtime.

What each stage keeps per rank (Ψ = parameter count):

* stage 0: full fp32 master + full optimizer state; grads all-reduced.
* stage 1: full compute copy, 1/W of master and optimizer state; grads reduced to the shard at the end.
* stage 2: stage 1, but grads are reduce-scattered per unit as backward produces them (1/W kept).
* stage 3: stage 2, and the compute copy too is gathered per unit just before its forward, freed after,
  re-gathered before its backward; the next unit is prefetched while this one computes.

Modules: :mod:`~dsfunc.zero.layout` (units, flat buffers, the ``torch.chunk`` split), ``binding``
(parameters into the skeleton), ``gather`` (compute copies; stage-3 gather and free), ``reduce``
(gradients over ranks), ``hooks`` (module hooks), ``runtime`` (one micro-batch's forward/backward; what it keeps
of the step in ``micro_batch``), ``materialize`` (from ``meta``), ``norms`` (norms over shards), ``memory`` (bytes
per rank), ``policy`` (where gradients, the update and the gathered shards live: three narrow interfaces),
``offload`` (ZeRO-Offload: the package that implements them with the host buffers masters, gradients and
parameters travel through), ``placeholders`` (the parameters ``zero.Init`` makes: sharded as they are built) and
``leaf`` (ZeRO-3 leaf modules).

DeepSpeed's names in its ``deepspeed.zero`` (``Init``, ``GatheredParameters``, ``unwrap_model_for_generation``,
``TiledLinear``, ...), which scripts reach as ``deepspeed.zero.Init``, live with the rest of the DeepSpeed surface
(:mod:`dsfunc.deepspeed.zero_context`); this package answers them too, looked up when first asked for (the
DeepSpeed surface imports this package's modules, not the other way round).
"""

from typing import Any

from dsfunc.zero.layout import ROOT, ParamSlot, ShardingPlan, Unit, chunk_range, make_plan
from dsfunc.zero.memory import memory_estimate
from dsfunc.zero.placeholders import ZeroParamStatus
from dsfunc.zero.runtime import MicroBatchRuntime, Phase

_DEEPSPEED_NAMES = frozenset({
    "GatheredParameters", "Init", "MiCS_Init", "TiledLinear", "TiledLinearReturnBias", "register_external_parameter",
    "unregister_external_parameter", "unwrap_model_for_generation",
})


def __getattr__(name: str) -> Any:
    """DeepSpeed's ``deepspeed.zero`` names, from :mod:`dsfunc.deepspeed.zero_context`."""
    if name not in _DEEPSPEED_NAMES:
        raise AttributeError(f"module 'dsfunc.zero' has no attribute {name!r}")
    from dsfunc.deepspeed import zero_context

    return getattr(zero_context, name)


__all__ = [
    "ROOT",
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "MicroBatchRuntime",
    "ParamSlot",
    "Phase",
    "ShardingPlan",
    "TiledLinear",
    "TiledLinearReturnBias",
    "Unit",
    "ZeroParamStatus",
    "chunk_range",
    "make_plan",
    "memory_estimate",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
