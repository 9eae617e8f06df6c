"""Regional compilation: each unit's forward compiled with ``torch.compile``, as torchtitan compiles each block.

Only the unit module's own ``forward`` is compiled; the module hooks that ZeRO-3 uses to gather and free
the unit's parameters run around it, outside the graph, so sharding costs no graph break. Parameters are
bound per micro-batch as fresh views of a flat leaf: dynamo treats them as graph inputs (not guarded by
identity), so rebinding recompiles nothing, and blocks of one class share one graph. A recompile (new
input shapes, say) is logged by dynamo with its reason (``torch._logging`` "recompiles", turned on here
unless ``TORCH_LOGS`` says otherwise): a loop whose shapes are static compiles once, in its first step.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from torch import nn

from dsfunc.config import CompileConfig
from dsfunc.zero.layout import ShardingPlan

logger = logging.getLogger("dsfunc")


def compile_units(skeleton: nn.Module, plan: ShardingPlan, options: CompileConfig) -> None:
    """Compile the forward of each unit's module in place (nothing when ``options.enabled`` is false)."""
    if not options.enabled:
        return
    modules = [skeleton.get_submodule(u.module) for u in plan.units if u.module is not None]
    if not modules:
        logger.warning("compile.enabled: the model has no unit modules (blocks of a ModuleList) to compile; "
                       "pass unit_modules=[...] to dsfunc.init_state to choose them")
    for module in modules:
        module.forward = torch.compile(module.forward, backend=options.backend, **dict(options.kwargs))
    # Dynamo reads .grad of every tensor it wraps; a unit's parameters are views of its flat leaf, so each
    # read warns that .grad of a non-leaf stays empty. Hidden for reads inside torch only.
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf",
                            category=UserWarning, module=r"torch\.")
    if "TORCH_LOGS" not in os.environ:
        torch._logging.set_logs(recompiles=True)
