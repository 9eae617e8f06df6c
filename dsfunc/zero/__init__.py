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
of the step in ``micro_batch``),
``materialize`` (from ``meta``), ``norms`` (norms over shards), ``memory`` (bytes per rank), ``offload``
(ZeRO-Offload: the host buffers masters, gradients and parameters travel through), and
``context``: DeepSpeed's ``zero.Init``, ``zero.GatheredParameters`` and ``unwrap_model_for_generation``, which
scripts call as ``deepspeed.zero.Init`` (so they are here, in dsfunc's ZeRO package, too), ``placeholders``
(the parameters ``zero.Init`` makes) and ``leaf`` (ZeRO-3 leaf modules).
"""

from dsfunc.errors import unsupported
from dsfunc.zero.context import (
                                    GatheredParameters,
                                    Init,
                                    register_external_parameter,
                                    unregister_external_parameter,
                                    unwrap_model_for_generation,
)
from dsfunc.zero.layout import ROOT, ParamSlot, ShardingPlan, Unit, chunk_range, make_plan
from dsfunc.zero.memory import memory_estimate
from dsfunc.zero.placeholders import ZeroParamStatus
from dsfunc.zero.runtime import MicroBatchRuntime, Phase

MiCS_Init = unsupported("deepspeed.zero.MiCS_Init", "MiCS sharding", "use deepspeed.zero.Init")
TiledLinear = unsupported("deepspeed.zero.TiledLinear", "ZeRO-3 tiled linear layers", "use torch.nn.Linear")
TiledLinearReturnBias = unsupported("deepspeed.zero.TiledLinearReturnBias", "ZeRO-3 tiled linear layers",
                                    "use torch.nn.Linear")

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
