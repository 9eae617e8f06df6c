"""Activation checkpointing of units: a unit's forward keeps only its inputs and runs again in backward.

Applied like regional compilation, to each selected unit module's own ``forward`` (the module hooks stay
outside), with ``torch.utils.checkpoint`` in its non-reentrant form:

* it composes with ZeRO-3: before a unit's backward the hook on its outputs re-gathers the unit
  (:mod:`dsfunc.zero.runtime`), so the recomputed forward reads the gathered parameters, and the unit is
  freed again once its gradient is reduced;
* dropout draws the same masks in the recomputation (the checkpoint restores the RNG state of the
  forward), so a checkpointed run trains bit for bit like one without, and resumes bit for bit;
* the ``"selective"`` policy saves the outputs of matmuls and attention (without dropout) and recomputes the
  rest (elementwise ops, norms), the usual trade of a little memory for most of the recompute time;
* ``cpu_checkpointing`` keeps the saved inputs in host memory: on a GPU copied out and prefetched back
  asynchronously, in pinned buffers of their exact size (:mod:`dsfunc.activation_offload`), elsewhere with
  ``torch.autograd.graph.save_on_cpu``; ``device_checkpoints`` keeps the last units' inputs on the device.

The same wrapper serves ``deepspeed.checkpointing.checkpoint(fn, *args)`` (:func:`checkpoint`), whose calls all
offload with ``cpu_checkpointing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from dsfunc.activation_offload import ActivationOffloader
from dsfunc.config import ActivationCheckpointingConfig
from dsfunc.zero.layout import ShardingPlan

logger = logging.getLogger("dsfunc")

_aten = torch.ops.aten
# Outputs the selective policy keeps: the matmuls and attention, whose recompute would cost the most.
_SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def checkpoint_units(skeleton: nn.Module, plan: ShardingPlan, options: ActivationCheckpointingConfig) -> int:
    """Checkpoint the forward of each unit module ``options`` selects, in place; returns how many.

    With ``cpu_checkpointing`` the chosen units share one :class:`ActivationOffloader` (the copies back follow their
    order), except the last ``device_checkpoints``, which keep their inputs on the device.
    """
    modules = [skeleton.get_submodule(u.module) for u in plan.units if u.module is not None]
    chosen = [m for i, m in enumerate(modules) if options.checkpoints(i)]
    if options.policy != "none" and not modules:
        logger.warning("activation_checkpointing.policy = %r: the model has no unit modules (blocks of a "
                       "ModuleList) to checkpoint; pass unit_modules=[...] to dsfunc.init_state", options.policy)
    offloader = offloader_for(options)
    on_device = dataclasses.replace(options, cpu_checkpointing=False, device_checkpoints=0)
    for i, module in enumerate(chosen):
        kept = i >= len(chosen) - options.device_checkpoints
        module.forward = functools.partial(checkpoint, module.forward, options=on_device if kept else options,
                                           offloader=None if kept else offloader)
    return len(chosen)


def offloader_for(options: ActivationCheckpointingConfig) -> ActivationOffloader | None:
    """The offloader of checkpoints that ``options`` keep in host memory: one when on CUDA, else None."""
    return ActivationOffloader() if options.cpu_checkpointing and torch.cuda.is_available() else None


def checkpoint(function: Callable[..., Any], *args: Any, options: ActivationCheckpointingConfig | None = None,
               offloader: ActivationOffloader | None = None, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs for backward and running it again there.

    With ``options.cpu_checkpointing`` the tensors of ``args`` go to host memory: through ``offloader`` where
    given (:func:`offloader_for`), else ``save_on_cpu``. Tensors in ``kwargs`` are kept by reference, on the device.
    """
    options = options or ActivationCheckpointingConfig(policy="units")
    # torch's own default when not selective: a compiled forward accepts only it or dispatch modes
    selective = {"context_fn": _selective} if options.policy == "selective" else {}
    if not options.cpu_checkpointing:
        on_cpu = contextlib.nullcontext()
    else:
        on_cpu = offloader.call() if offloader is not None else \
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    # entered only when asked: its host clock and syncs would break a graph that compiles this forward
    bounded = options.synchronize_checkpoint_boundary or options.profile
    with _boundary(options, function) if bounded else contextlib.nullcontext(), on_cpu:
        return torch_checkpoint(function, *args, use_reentrant=False, **selective, **kwargs)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the matmuls' and attention's outputs, but not an attention that draws dropout: a saved op is not run
    again in the recomputation, so it would not advance the RNG as the forward did, and every dropout after it
    would draw other masks than the forward's (wrong gradients: seen with CUDA's fused attention)."""
    if op not in _SAVED_OPS or _dropout_p(op, args, kwargs) > 0.0:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _dropout_p(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return 0.0
    i = names.index("dropout_p")
    return float(args[i] if i < len(args) else kwargs.get("dropout_p", 0.0))


def _selective() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_policy)


@contextlib.contextmanager
def _boundary(options: ActivationCheckpointingConfig, function: Callable[..., Any]) -> Iterator[None]:
    """DeepSpeed's ``synchronize_checkpoint_boundary`` and ``profile`` around one checkpointed forward."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if options.profile:
        name = getattr(function, "__qualname__", type(function).__name__)
        logger.info("activation checkpointing: forward of %s took %.2f ms", name, (time.perf_counter() - start) * 1e3)
