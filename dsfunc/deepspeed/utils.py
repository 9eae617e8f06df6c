"""``deepspeed.utils`` (and ``deepspeed.runtime.utils``): the helpers DeepSpeed scripts import.

Logging (``logger``, ``log_dist``), ``RepeatingLoader``, ``OnDevice``, ``set_random_seed``,
``see_memory_usage``, the module helpers ``recursive_getattr``/``recursive_setattr``, the ZeRO-3 leaf
modules (``set_z3_leaf_modules`` and its family, :mod:`dsfunc.zero.leaf`), and the
``safe_get_full_fp32_param`` family, which reads and writes one parameter's fp32 master weights,
Adam moments, and its gradient of the step in progress (between a backward and ``engine.step()``, from the
micro-batch runtime's reducer) in an engine's state (a collective at ZeRO stages 1-3: every rank calls it), and
the ``safe_get_local_*`` family, this rank's ZeRO-3 partition of the same;
other names of DeepSpeed's utils import and raise when called.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree

# no global named ``torch``: this module is also ``deepspeed.utils``, whose submodule ``deepspeed.utils.torch``
# (dsfunc.deepspeed.torch_version) takes that attribute when a script imports it
from torch import Tensor, get_default_dtype, manual_seed, nn, no_grad, set_default_dtype
from torch import device as torch_device
from torch import dtype as torch_dtype
from torch import empty as torch_empty
from torch import float32 as torch_float32

from dsfunc.deepspeed.live_engines import engine_of
from dsfunc.deepspeed.namespace import ALIASES
from dsfunc.distributed import comm
from dsfunc.errors import InputError, unsupported
from dsfunc.optim.transforms import ScaleByAdamState
from dsfunc.zero.gather import Workspace, owner
from dsfunc.zero.layout import ParamSlot, Unit
from dsfunc.zero.leaf import (  # noqa: F401 - DeepSpeed's names, answered here
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

logger = logging.getLogger("dsfunc")
_ONCE: set[str] = set()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks (all when ``ranks`` is None or holds -1), as DeepSpeed's."""
    if ranks is None or -1 in ranks or comm.rank() in ranks:
        logger.log(level, "[Rank %d] %s", comm.rank(), message)


def log_dist_once(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, once per message."""
    if message not in _ONCE:
        _ONCE.add(message)
        log_dist(message, ranks, level)


def set_random_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (DeepSpeed's ``runtime.utils.set_random_seed``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    manual_seed(seed % 2**63)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's memory (only with ``force``, as DeepSpeed's)."""
    if not force:
        return
    from dsfunc.deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    log_dist(f"{message} | MA {acc.memory_allocated() / 2**30:.2f} GB | Max_MA {acc.max_memory_allocated() / 2**30:.2f} GB",
             ranks=[0])


class RepeatingLoader:
    """Wraps an iterable so that it restarts when exhausted (an endless loader), as DeepSpeed's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


@contextlib.contextmanager
def OnDevice(dtype: torch_dtype | None = None, device: str | torch_device = "meta", enabled: bool = True) -> Iterator[None]:
    """Create tensors on ``device`` (default ``meta``) and floating ones in ``dtype`` inside the block."""
    if not enabled:
        yield
        return
    previous = get_default_dtype()
    with torch_device(device):
        if dtype is not None:
            set_default_dtype(dtype)
        try:
            yield
        finally:
            set_default_dtype(previous)


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """``model.a.b.c`` for ``"a.b.c"``."""
    out: Any = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``"a.b.c"``."""
    path, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, path) if path else model, last, module)


# -- one parameter's master weights and optimizer state ------------------------------------------------
def _locate(param: Tensor) -> tuple[Workspace, Unit, ParamSlot]:
    found = owner(param)
    if found is None:
        raise InputError("the tensor is not a parameter of a module an engine (or init_state(in_place=True)) trains")
    workspace, unit = found
    workspace.settle()  # the masters and moments are final (a host update may still write them)
    index = next(i for i, p in enumerate(workspace.binding.residents(unit.name)) if p is param)
    return workspace, unit, unit.params[index]


def _full(param: Tensor, shard_of: Any) -> Tensor:
    workspace, unit, slot = _locate(param)
    full = workspace.full_flat(unit, shard_of(workspace, unit))
    return full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()


def _write(workspace: Workspace, unit: Unit, slot: ParamSlot, shard: Tensor, value: Tensor) -> None:
    """Write ``value`` at ``slot`` of the unit's flat whose shard on this rank is ``shard``."""
    full = workspace.full_flat(unit, shard)
    with no_grad():
        full[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
        if full is not shard:
            shard.copy_(full[slice(*workspace.plan.shard_bounds(unit))])


def safe_get_full_fp32_param(param: Tensor) -> Tensor | None:
    """The full fp32 master weight of ``param`` (every rank calls it at ZeRO stages 1-3); None for a frozen
    parameter, which has none (as DeepSpeed's)."""
    if not param.requires_grad:
        return None
    return _full(param, lambda ws, unit: ws.master[unit.name])


def safe_set_full_fp32_param(param: Tensor, value: Tensor) -> None:
    """Make ``value`` the fp32 master weight of ``param`` (and its compute copy); every rank calls it."""
    workspace, unit, slot = _locate(param)
    _write(workspace, unit, slot, workspace.master[unit.name], value)
    workspace.refresh(workspace.master)


_MOMENTS = {"exp_avg": "mu", "exp_avg_sq": "nu"}


def _moments(workspace: Workspace, unit: Unit) -> ScaleByAdamState:
    opt_state = engine_of(workspace).state.opt_state
    for node in optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleByAdamState)):
        if isinstance(node, ScaleByAdamState) and unit.name in node.mu:
            return node
    raise InputError("the engine's optimizer keeps no Adam moments (exp_avg, exp_avg_sq) for this parameter")


def safe_get_full_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    """The full ``exp_avg`` or ``exp_avg_sq`` of ``param`` in its engine's Adam state (every rank calls it); None
    for a frozen parameter."""
    if not param.requires_grad:
        return None
    if optim_state_key not in _MOMENTS:
        raise InputError(f"optim_state_key {optim_state_key!r}: dsfunc keeps 'exp_avg' and 'exp_avg_sq'")
    field = _MOMENTS[optim_state_key]
    return _full(param, lambda ws, unit: getattr(_moments(ws, unit), field)[unit.name])


def safe_set_full_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """Make ``value`` the full ``exp_avg``/``exp_avg_sq`` of ``param`` (every rank calls it)."""
    if optim_state_key not in _MOMENTS:
        raise InputError(f"optim_state_key {optim_state_key!r}: dsfunc keeps 'exp_avg' and 'exp_avg_sq'")
    workspace, unit, slot = _locate(param)
    _write(workspace, unit, slot, getattr(_moments(workspace, unit), _MOMENTS[optim_state_key])[unit.name], value)


_NO_GRADIENTS = "Gradients are only available immediately after backward and before engine step"


def _step_grad(param: Tensor, copy: bool = False) -> tuple[Workspace, Unit, ParamSlot, Tensor | None, bool]:
    """Where ``param``'s gradient of the step in progress is: its unit's sum so far and whether it is reduced (see
    :meth:`~dsfunc.zero.reduce.ZeroReducer.so_far`; ``copy``: a copy of one offloaded to the host). Raises
    ValueError where DeepSpeed's helpers do: between steps, and off the accumulation boundary at ZeRO-2 (unless the
    optimizer is offloaded: DeepSpeed then reduces every micro-batch's gradients to the host, and reads them)."""
    workspace, unit, slot = _locate(param)
    engine = engine_of(workspace)
    runtime = engine.steps.runtime
    stage = workspace.plan.stage
    offloaded = engine.state.program.run.grads.off_device
    off_boundary = stage == 2 and not offloaded and not engine.steps.is_boundary()
    if runtime is None or not runtime.has_gradients or off_boundary:
        raise ValueError(_NO_GRADIENTS)
    total, reduced = runtime.reducer.so_far(unit, copy)
    return workspace, unit, slot, total, reduced


def safe_get_full_grad(param: Tensor) -> Tensor | None:
    """The gradient of ``param`` in the step so far, full and fp32, as DeepSpeed's: after a backward and before
    ``engine.step()``; the mean over the ranks once reduced (at the accumulation boundary; every micro-batch at
    ZeRO-3), else this rank's own (stages 0-1). Every rank calls it (a collective at stages 1-3). None before any
    backward reached it, and for a frozen parameter. With the optimizer offloaded it is the sum so far at every
    micro-batch (DeepSpeed's, off the boundary at stages 2-3, is what its host buffer last held)."""
    if not param.requires_grad:
        return None
    workspace, unit, slot, total, reduced = _step_grad(param, copy=True)
    if total is None:
        return None
    if not reduced:  # this rank's own sum: the backward seed divided it by the ranks
        total = total.float() * workspace.plan.world_size
    elif workspace.plan.stage >= 1:
        total = workspace.full_flat(unit, total)
    return total[slot.offset : slot.offset + slot.numel].view(slot.shape).float().clone()


def safe_set_full_grad(param: Tensor, value: Tensor) -> None:
    """Make ``value`` the gradient of ``param`` that the next ``engine.step()`` applies (at the accumulation
    boundary, after the backward; every rank calls it with the same value)."""
    workspace, unit, slot, total, reduced = _step_grad(param)
    if total is None or not reduced:
        raise ValueError(f"{_NO_GRADIENTS}: dsfunc sets a gradient once the step's gradients are reduced, after the "
                         "backward of its last micro-batch")
    _write(workspace, unit, slot, total, value)


def safe_update_full_grad_vectorized(param_list: list[Tensor], update_func: Any) -> None:
    """Make ``update_func(full_grad, param)`` the gradient of each trainable parameter of ``param_list`` that the
    next ``engine.step()`` applies (DeepSpeed's batched :func:`safe_set_full_grad`; every rank calls it)."""
    for param in param_list:
        if param.requires_grad:
            safe_set_full_grad(param, update_func(safe_get_full_grad(param), param))


# -- this rank's partition of one parameter (DeepSpeed's ZeRO-3 "local" helpers) ------------------------------
# [Note: a parameter's local partition]
# DeepSpeed partitions each ZeRO-3 parameter on its own: rank r holds elements [r*c, (r+1)*c) of the flattened
# parameter, c = ceil(numel / world), the last piece padded (its ``ds_tensor``). dsfunc partitions a unit's flat
# buffer instead, so that piece is cut from the full value (gathered) and a new piece is written through the full
# value (its pieces gathered): the local helpers answer DeepSpeed's shapes and values, and are collectives here
# (every rank calls them, as with the full ones).


def _local_piece(param: Tensor, full: Tensor | None) -> Tensor | None:
    """This rank's piece of ``param``'s full value (see the note), padded with zeros."""
    if full is None:
        return None
    workspace, unit, _slot = _locate(param)
    group = workspace.plan.group_of(unit)  # an expert's: its expert-data-parallel ranks
    flat, world = full.reshape(-1), group.size
    chunk = -(-flat.numel() // world)
    padded = flat.new_zeros(chunk * world)
    padded[: flat.numel()] = flat
    return padded[group.rank * chunk : (group.rank + 1) * chunk].clone()


def _from_pieces(param: Tensor, piece: Tensor) -> Tensor:
    """The full fp32 value whose pieces the ranks hold (every rank gives its own ``piece``)."""
    workspace, unit, slot = _locate(param)
    group = workspace.plan.group_of(unit)
    chunk = -(-slot.numel // group.size)
    if piece.numel() != chunk:
        raise InputError(f"the value has {piece.numel()} elements; this rank's partition of the parameter has {chunk} "
                         f"(ceil({slot.numel} / {group.size} ranks))")
    full = torch_empty(chunk * group.size, dtype=torch_float32, device=piece.device)
    comm.all_gather_flat(full, piece.reshape(-1).to(torch_float32), group)
    return full[: slot.numel].view(slot.shape)


def _zero3(param: Tensor) -> None:
    workspace, _unit, _slot = _locate(param)
    if workspace.plan.stage != 3:
        raise InputError("the local helpers are defined for ZeRO-3 partitioned parameters (as in DeepSpeed); at "
                         f"stage {workspace.plan.stage} use the safe_get_full_*/safe_set_full_* helpers")


def safe_get_local_fp32_param(param: Tensor) -> Tensor | None:
    """This rank's partition of the fp32 master weight of ``param`` (ZeRO-3; see the note: a collective)."""
    if not param.requires_grad:  # a frozen parameter has none, as in DeepSpeed
        return None
    _zero3(param)
    return _local_piece(param, safe_get_full_fp32_param(param))


def safe_get_local_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    """This rank's partition of ``exp_avg``/``exp_avg_sq`` of ``param`` (ZeRO-3; a collective)."""
    if not param.requires_grad:  # a frozen parameter has none, as in DeepSpeed
        return None
    _zero3(param)
    return _local_piece(param, safe_get_full_optimizer_state(param, optim_state_key))


def safe_get_local_grad(param: Tensor) -> Tensor | None:
    """This rank's partition of the gradient of ``param`` in the step so far, fp32 (ZeRO-3; a collective)."""
    if not param.requires_grad:  # a frozen parameter has none, as in DeepSpeed
        return None
    _zero3(param)
    return _local_piece(param, safe_get_full_grad(param))


def safe_set_local_fp32_param(param: Tensor, value: Tensor) -> None:
    """Make ``value`` this rank's partition of the fp32 master weight of ``param`` (ZeRO-3; every rank calls it)."""
    if not param.requires_grad:
        return
    _zero3(param)
    safe_set_full_fp32_param(param, _from_pieces(param, value))


def safe_set_local_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """Make ``value`` this rank's partition of ``exp_avg``/``exp_avg_sq`` of ``param`` (ZeRO-3; every rank)."""
    if not param.requires_grad:
        return
    _zero3(param)
    safe_set_full_optimizer_state(param, _from_pieces(param, value), optim_state_key)


def safe_set_local_grad(param: Tensor, value: Tensor) -> None:
    """Make ``value`` this rank's partition of the gradient the next ``engine.step()`` applies (ZeRO-3; every rank)."""
    if not param.requires_grad:
        return
    _zero3(param)
    safe_set_full_grad(param, _from_pieces(param, value))


def instrument_w_nvtx(func: Any) -> Any:
    """DeepSpeed's NVTX range decorator: the function itself."""
    return func


def __getattr__(name: str) -> Any:
    """Any other public name of DeepSpeed's utils imports, and raises when called."""
    if name.startswith("_"):
        raise AttributeError(name)
    if f"utils.{name}" in ALIASES:  # a DeepSpeed submodule dsfunc answers (``from deepspeed.utils import groups``)
        return importlib.import_module(ALIASES[f"utils.{name}"])
    return unsupported(f"deepspeed.utils.{name}", "a DeepSpeed utility dsfunc does not provide")
