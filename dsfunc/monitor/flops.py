"""Model FLOPs, counted once on a meta copy of the model with ``torch.utils.flop_counter``.

:func:`count_flops` runs one micro-batch's forward and backward through a copy of the model whose parameters,
buffers and inputs are ``meta`` tensors (shapes and dtypes, no storage): nothing is computed or allocated on a
device, so it costs the same for a 70B model as for a tiny one, and it never touches the run's own tensors.
``FlopCounterMode`` counts what the hardware's matrix units do (matrix products, convolutions, attention);
elementwise work is left out, as in the usual MFU arithmetic (6 x parameters x tokens for a transformer's
matrix products, plus attention).

[Note: counting on a meta copy] The copy is ``copy.deepcopy`` of the module with every parameter and buffer
replaced (through deepcopy's memo, so they are never copied) by a meta tensor of the full shape and the compute
dtype: a ZeRO-3 placeholder's full shape comes from the sharding plan, and a bound or sharded tensor is never
read. dsfunc's own hooks (ZeRO-3 gathers, the input cast, the engine's direct-call hooks) and forward wrappers
(activation checkpointing, ``torch.compile``) are dropped from the copy, so it runs the module's own code once
and counts model FLOPs (a checkpointed forward computed again in the backward is not model work); floating
inputs take the compute dtype, as the input cast does for the real run. A value the model's code reads from a
tensor (``.item()``, ``if mask.all():``) reads as 1 during the count; shapes that depend on values (``nonzero``,
``masked_select``) cannot be counted and the count fails.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from dsfunc.zero.hooks import tensors_in


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                            **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch's counter knows the CUDA attention kernels but not the CPU one (it would count 0): torch's own formulas
_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` that does not print, and counts attention on the CPU too."""
    return FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)


class _ScalarsReadAsOne(TorchDispatchMode):
    """A meta tensor's ``.item()`` (``bool(t)``, ``int(t)``) reads 1: the FLOPs depend on shapes, and models test
    values on the way (Hugging Face's ``attention_mask.all()`` before choosing its attention mask)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """What one micro-batch of ``samples`` samples costs: FLOPs of its forward and of its backward, and each
    module's share of the forward (``named_modules()`` paths, ``""`` the model)."""

    forward: int
    backward: int
    samples: int
    modules: Mapping[str, int]
    """Forward FLOPs by module path (modules whose forward counted none are left out)."""
    params: Mapping[str, int]
    """Parameters by module path (full shapes; a shared tensor counted once per module)."""
    kinds: Mapping[str, str]
    """Class name by module path."""

    @property
    def per_sample(self) -> float:
        """Forward plus backward FLOPs per sample."""
        return (self.forward + self.backward) / self.samples


def meta_copy(model: nn.Module, dtype: torch.dtype, shapes: Mapping[str, tuple[int, ...]] | None = None) -> nn.Module:
    """A copy of ``model`` on ``meta``: floating tensors in ``dtype``, each tensor of shape ``shapes[name]`` where
    given (see [Note: counting on a meta copy])."""
    shapes = shapes or {}
    memo: dict[int, Any] = {}
    named = itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if id(t) in memo:
            continue
        meta = torch.empty(shapes.get(name, t.shape), dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if _is_param(model, name) else meta
    for module in model.modules():
        if "_dsfunc_hooks" in module.__dict__:
            memo[id(module.__dict__["_dsfunc_hooks"])] = []
    twin = copy.deepcopy(model, memo)
    for module in twin.modules():
        for attr in _HOOK_DICTS:
            getattr(module, attr).clear()
        module.__dict__.pop("_dsfunc_hooks", None)
        if "_dsfunc_own_forward" in module.__dict__:
            own = module.__dict__.pop("_dsfunc_own_forward")
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        module._compiled_call_impl = None
    return twin


def _is_param(model: nn.Module, name: str) -> bool:
    path, _, attr = name.rpartition(".")
    return attr in (model.get_submodule(path) if path else model)._parameters


def count_flops(
    model: nn.Module,
    run: Callable[[nn.Module, Any], Any],
    batch: Any,
    *,
    samples: int,
    dtype: torch.dtype = torch.float32,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> FlopCount:
    """FLOPs of ``run(model, batch)`` and of the backward of what it returns, on a meta copy.

    Args:
      model: the module (left untouched: see [Note: counting on a meta copy]).
      run: ``(model, batch) -> output``: a loss, or outputs whose floating tensors that need a gradient are
        back-propagated with gradients of ones.
      batch: one micro-batch (only its tensors' shapes and dtypes are read).
      samples: the samples in ``batch``.
      dtype: the compute dtype (the copy's floating parameters and inputs).
      shapes: full shapes by parameter name, for tensors the module holds sharded or as placeholders.

    Raises whatever the module's forward raises on meta tensors (shapes that depend on values).
    """
    twin = meta_copy(model, dtype, shapes)

    def cast(module: nn.Module, args: Any, kwargs: Any) -> Any:
        f = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        return optree.tree_map(f, args), optree.tree_map(f, kwargs)

    twin.register_forward_pre_hook(cast, with_kwargs=True)
    to_meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t
    meta_batch = optree.tree_map(to_meta, batch)
    with flop_counter() as forward, _ScalarsReadAsOne():
        out = run(twin, meta_batch)
    roots = [t for t in tensors_in(out) if t.requires_grad]
    with flop_counter() as backward, _ScalarsReadAsOne():
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    return flop_count(twin, forward, backward.get_total_flops(), samples)


def flop_count(model: nn.Module, forward: FlopCounterMode, backward: int, samples: int) -> FlopCount:
    """A :class:`FlopCount` from a counter of ``model``'s forward (it names modules ``<root class>.<path>``)."""
    root = type(model).__name__
    modules = {}
    for name, ops in forward.get_flop_counts().items():
        if name != "Global":
            modules["" if name == root else name.removeprefix(root + ".")] = sum(ops.values())
    return FlopCount(forward.get_total_flops(), backward, samples, modules,
                     {path: sum(p.numel() for p in m.parameters()) for path, m in model.named_modules()},
                     {path: type(m).__name__ for path, m in model.named_modules()})
