"""The ZeRO context managers DeepSpeed scripts use: ``zero.Init`` and ``zero.GatheredParameters``.

``Init`` builds a model without memory: under it each parameter goes to the ``meta`` device as it is
registered (buffers are built as usual, as DeepSpeed leaves them whole), and
:func:`dsfunc.init_state` (so ``deepspeed.initialize``) materialises only this rank's shard, one
module at a time, with each module's ``reset_parameters()`` (or ``param_init_fn``). The values
initialisation code gave parameters at construction are dropped; values written through
``GatheredParameters(params, modifier_rank=r)`` before ``initialize`` (how Hugging Face initialises
and loads a ZeRO-3 model) are kept, sharded, and used instead (:mod:`dsfunc.zero.pending`).

``GatheredParameters(params, modifier_rank=None)`` makes the full values of a module's ZeRO-3
parameters visible inside the ``with`` block (outside, they are empty, as DeepSpeed's). Every rank must
enter it (the parameters are all-gathered). With ``modifier_rank`` the parameters show the fp32
master weights instead, and what that rank writes into them becomes the trained value on every rank
(its master shard, its compute copy) when the block ends — at any ZeRO stage, where DeepSpeed's
stages 0-2 would keep such a write in the 16-bit module only. Tensors that no dsfunc state trains in
place are left alone, as DeepSpeed leaves parameters without ``ds_id``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dsfunc.distributed import comm
from dsfunc.distributed.init import join_world
from dsfunc.errors import NotSupportedError
from dsfunc.zero.gather import Workspace, owner
from dsfunc.zero.layout import Unit
from dsfunc.zero.pending import Exposed


class Init:
    """DeepSpeed's ``zero.Init``: the parameters of modules built inside it land on ``meta`` (see the module
    docstring); buffers are built as usual.

    The arguments are DeepSpeed's; ``enabled=False`` makes it a no-op, ``module=`` (converting a built
    model) needs nothing since ``initialize`` shards any model, and the rest configure DeepSpeed's own
    partitioning, which ``initialize`` does here, so they are accepted and unused. ``remote_device="cpu"``
    is accepted too: where the state lives is the config's ``offload_optimizer`` / ``offload_param``
    (host memory), the model is still built on ``meta``; ``"nvme"`` is refused.
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
        self._register: Any = None  # nn.Module.register_parameter while inside
        if self.enabled:
            join_world()  # as DeepSpeed's: loading under it (GatheredParameters) is collective

    def __enter__(self) -> Init:  # noqa: PYI034 - DeepSpeed's class, not meant to be subclassed
        if self.enabled:
            self._register = nn.Module.register_parameter
            nn.Module.register_parameter = _on_meta(self._register)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._register is not None:
            nn.Module.register_parameter = self._register
            self._register = None


def _on_meta(register: Any) -> Any:
    """``nn.Module.register_parameter`` that puts each parameter on ``meta`` as it is registered (its values
    are dropped; one parameter exists at a time); buffers are left as built (a rotary embedding's)."""

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    return register_on_meta


class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        tensors = [] if params is None else [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._meta = Exposed([t for t in tensors if t.is_meta])  # built under zero.Init, before initialize
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
        self._meta.expose()
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
        self._meta.hide(self.modifier_rank)
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
