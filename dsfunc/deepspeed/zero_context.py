"""The ZeRO context managers DeepSpeed scripts use, ``zero.Init`` and ``zero.GatheredParameters``, and DeepSpeed's
other ``deepspeed.zero`` names (:mod:`dsfunc.zero` answers them from here).

``Init`` builds a model without memory, as DeepSpeed's does: each parameter made under it keeps the value
its construction gave it, but once its module is built (attached to a parent, or when the block ends) it
is partitioned: rank 0's value kept in pieces over the ranks, the parameter itself an empty tensor on the
device with DeepSpeed's ``ds_*`` attributes (:mod:`dsfunc.zero.placeholders`). Buffers are built as usual,
as DeepSpeed leaves them whole. Values written through ``GatheredParameters(params, modifier_rank=r)``
before ``initialize`` (how Hugging Face initialises and loads a ZeRO-3 model) replace the pieces;
:func:`dsfunc.init_state` (so ``deepspeed.initialize``) builds each rank's shard from them.

``GatheredParameters(params, modifier_rank=None)`` makes the full values of a module's ZeRO-3
parameters visible inside the ``with`` block (outside, they are empty, as DeepSpeed's). Every rank must
enter it (the parameters are all-gathered). With ``modifier_rank`` the parameters show the fp32
master weights instead, and what that rank writes into them becomes the trained value on every rank
(its master shard, its compute copy) when the block ends — at any ZeRO stage, where DeepSpeed's
stages 0-2 would keep such a write in the 16-bit module only. Tensors that no dsfunc state trains in
place are left alone, as DeepSpeed leaves parameters without ``ds_id``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle

from dsfunc.distributed import comm
from dsfunc.distributed.process_group import join_world
from dsfunc.errors import NotSupportedError, unsupported
from dsfunc.zero.gather import Workspace, owner
from dsfunc.zero.layout import Unit
from dsfunc.zero.placeholders import Exposed, is_placeholder, partition


class Init:
    """DeepSpeed's ``zero.Init``: the parameters of modules built inside it are partitioned as each module is
    built (see the module docstring); buffers are built as usual.

    The arguments are DeepSpeed's; ``enabled=False`` makes it a no-op and ``module=`` partitions the
    parameters of a built model at once. The rest configure DeepSpeed's own partitioning, which
    ``initialize`` does here, so they are accepted and unused: the pieces keep each parameter's dtype
    (``initialize`` makes the fp32 masters from them) and live where the collectives run.
    ``remote_device="cpu"`` is accepted too: where the state lives is the config's ``offload_optimizer`` /
    ``offload_param`` (host memory); ``"nvme"`` is refused.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **kwargs: Any) -> None:
        if remote_device not in (None, "none", "cpu"):
            raise NotSupportedError(f"zero.Init(remote_device={remote_device!r}): parameter offload to NVMe is not "
                                    'built in dsfunc; use remote_device="cpu" with "offload_param": {"device": '
                                    '"cpu"} in the config, or leave remote_device out')
        self.enabled = enabled and module is None
        self._made: dict[int, tuple[nn.Module, str, nn.Parameter]] = {}  # id(param) -> where it was registered
        self._handles: list[RemovableHandle] = []
        if enabled:
            join_world()  # as DeepSpeed's: partitioning (and loading under it: GatheredParameters) is collective
        if enabled and module is not None:
            for p in module.parameters():
                partition(p)

    def __enter__(self) -> Init:  # noqa: PYI034 - DeepSpeed's class, not meant to be subclassed
        if self.enabled:
            self._handles = [register_module_parameter_registration_hook(self._registered),
                             register_module_module_registration_hook(self._attached)]
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        made, self._made = self._made, {}
        if exc_type is None:  # what no built module took: the root's own parameters, a module never attached
            for module, name, param in made.values():
                if module._parameters.get(name) is param:
                    partition(param)

    def _registered(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        """A parameter made inside: partitioned once its module is built (its ``__init__`` may still
        initialise it: ``nn.Linear`` calls ``reset_parameters()`` after registering its weight)."""
        if param is not None:
            self._made[id(param)] = (module, name, param)

    def _attached(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        """A module attached to its parent is built: partition the parameters made inside, in its order."""
        if child is None:
            return
        for param in child.parameters():
            if id(param) in self._made and not is_placeholder(param):
                partition(param)


class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        tensors = [] if params is None else [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._made = Exposed([t for t in tensors if is_placeholder(t)])  # built under zero.Init, before initialize
        self._units: dict[int, tuple[Workspace, list[Unit]]] = {}
        for t in tensors:
            found = owner(t)
            if found is not None:
                workspace, unit = found
                entry = self._units.setdefault(id(workspace), (workspace, []))
                if unit not in entry[1]:
                    entry[1].append(unit)

    def __enter__(self) -> GatheredParameters:  # noqa: PYI034 - DeepSpeed's class, not subclassed
        if not self.enabled:
            return self
        self._made.expose()
        for workspace, units in self._ordered():
            for unit in units:
                if self.modifier_rank is None:
                    workspace.expose(unit)
                else:
                    workspace.expose_master(unit)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self._made.hide(self.modifier_rank)
        for workspace, units in self._ordered():
            if self.modifier_rank is None:
                for unit in units:
                    workspace.hide(unit)
            else:
                workspace.commit_master(units, self.modifier_rank)

    def _ordered(self) -> Iterable[tuple[Workspace, list[Unit]]]:
        """The units in plan order (every rank issues the same collectives in the same order)."""
        for workspace, units in self._units.values():
            yield workspace, [u for u in workspace.plan.units if u in units]


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation(engine)``: every ZeRO-3 parameter of
    the engine's module gathered for the block, so the many forwards of a ``generate`` gather nothing more
    (its units' hooks find them gathered); yields the engine. Every rank must enter it."""
    with GatheredParameters(getattr(model, "module", model).parameters()):
        yield model


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's hint that ``module`` uses ``parameter`` of another module. Nothing to record: dsfunc
    gathers per unit, and the root unit (everything outside the blocks of the largest ModuleList) is
    never freed; a block's parameter used outside that block's forward needs ``unit_modules`` without
    that block at ZeRO-3."""


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (nothing to undo)."""


def gathered_state_dict(module: nn.Module, *, to_rank: int = 0,
                        exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
    """``module``'s ``state_dict`` with every ZeRO-3 unit gathered, one unit at a time, as CPU copies on
    rank ``to_rank`` (``None`` elsewhere); every rank must call it. For a module no state trains in
    place it is a CPU copy of ``module.state_dict()``."""
    mine = comm.rank() == to_rank
    held = module.state_dict(keep_vars=True)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} if exclude_frozen_parameters else set()
    out: dict[str, torch.Tensor] = {}
    by_unit: dict[int, tuple[Workspace, Unit, list[str]]] = {}
    for key, t in held.items():
        found = owner(t) if key not in frozen else None
        if found is None or not found[0].lazy(found[1]):
            if mine and key not in frozen:
                out[key] = t.detach().to("cpu", copy=True)
            continue
        by_unit.setdefault(id(found[1]), (*found, []))[2].append(key)
    for workspace, unit, keys in sorted(by_unit.values(), key=lambda e: e[0].plan.units.index(e[1])):
        workspace.expose(unit)
        try:
            for key in keys if mine else ():
                out[key] = held[key].detach().to("cpu", copy=True)
        finally:
            workspace.hide(unit)
    return {k: out[k] for k in held if k in out} if mine else None


MiCS_Init = unsupported("deepspeed.zero.MiCS_Init", "MiCS sharding", "use deepspeed.zero.Init")
TiledLinear = unsupported("deepspeed.zero.TiledLinear", "ZeRO-3 tiled linear layers", "use torch.nn.Linear")
TiledLinearReturnBias = unsupported("deepspeed.zero.TiledLinearReturnBias", "ZeRO-3 tiled linear layers",
                                    "use torch.nn.Linear")
