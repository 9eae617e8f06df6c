"""The forward compiled with ``torch.compile``: each unit's (regional compilation, as torchtitan compiles each
block), or the whole model's as one graph (``compile.scope``).

Only a module's own ``forward`` is compiled; its module hooks run around it, outside the graph. With scope
"units" the hooks that ZeRO-3 uses to gather and free a unit's parameters cost no graph break; with scope
"model" the compiled forward holds the embeddings, every unit, the final norm, the output projection and a loss
the model computes, which the compiler can fuse (the head with the cross-entropy, as ``torch.compile(model)``
does), but no gathers: ZeRO-3 is refused. Parameters are bound per micro-batch as fresh views of a flat leaf:
dynamo treats them as graph inputs (not guarded by identity), so rebinding recompiles nothing, and blocks of
one class share one graph. A recompile (new input shapes, say) is logged by dynamo with its reason
(``torch._logging`` "recompiles", turned on here unless ``TORCH_LOGS`` says otherwise): a loop whose shapes
are static compiles once, in its first step.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from torch import nn

from dsfunc.config import ActivationCheckpointingConfig, CompileConfig, ConfigError
from dsfunc.zero.layout import ShardingPlan

logger = logging.getLogger("dsfunc")


def compile_forwards(skeleton: nn.Module, plan: ShardingPlan, options: CompileConfig,
                     remat: ActivationCheckpointingConfig) -> None:
    """Compile the forward of each unit's module, or of ``skeleton`` itself, in place (as ``options.scope``
    says; nothing when ``options.enabled`` is false). ``remat`` is the checkpointing the units were given."""
    if not options.enabled:
        return
    if options.scope == "model":
        _check_whole_model(plan, remat)
        modules = [skeleton]
    else:
        modules = [skeleton.get_submodule(u.module) for u in plan.units if u.module is not None]
        if not modules:
            logger.warning('compile.enabled: the model has no unit modules (blocks of a ModuleList) to compile; '
                           'pass unit_modules=[...] to dsfunc.init_state to choose them, or set compile.scope '
                           'to "model"')
    for module in modules:
        # what dsfunc.init_state restores before it prepares the module again (a second state on one module)
        module.__dict__.setdefault("_dsfunc_own_forward", module.__dict__.get("forward"))
        module.forward = torch.compile(module.forward, backend=options.backend, **dict(options.kwargs))
    # Dynamo reads .grad of every tensor it wraps; a unit's parameters are views of its flat leaf, so each
    # read warns that .grad of a non-leaf stays empty. Hidden for reads inside torch only.
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf",
                            category=UserWarning, module=r"torch\.")
    if "TORCH_LOGS" not in os.environ:
        torch._logging.set_logs(recompiles=True)


def _check_whole_model(plan: ShardingPlan, remat: ActivationCheckpointingConfig) -> None:
    """The model's forward as one graph holds no collectives (ZeRO-3 gathers each unit inside it) and no host
    work around a checkpointed unit: dynamo would give up on the whole forward and run it eagerly, silently."""
    if plan.stage == 3:
        raise ConfigError(
            'compile.scope = "model" is invalid with zero_optimization.stage 3: ZeRO-3 gathers and frees each '
            "unit's parameters in module hooks inside the model's forward, which one compiled graph cannot hold. "
            'Use compile.scope "units" (each unit compiled, the gathers between them), or ZeRO stage 0-2.'
        )
    host = remat.host_work()
    if host:
        raise ConfigError(
            f'compile.scope = "model" is invalid with activation_checkpointing.{host[0]} = true: it runs host work '
            "(a host copy, a device sync, a timer) around each checkpointed unit, which one compiled graph cannot "
            f'hold. Turn activation_checkpointing.{host[0]} off, or use compile.scope "units" (each unit compiled, '
            "the host work around it)."
        )
