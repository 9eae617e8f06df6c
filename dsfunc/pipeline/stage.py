"""A pipeline stage's module: the layers one stage holds, built from a list of layers.

The layer list is DeepSpeed's: ``nn.Module`` instances, :class:`LayerSpec` (a class and its arguments,
built only on the stage that holds it), :class:`TiedLayerSpec` (one module shared by every layer with its
key: an input embedding reused as the output head) and plain callables (no parameters). A
:class:`StageModule` holds stage ``s``'s slice of the list; its ``forward`` runs them in order, the output
of one the input of the next. Names follow DeepSpeed's ``PipelineModule``: a layer is the submodule
``"<global index>"``, a tied module ``"tied_modules.<key>"``, so a state dict's keys do not depend on the
number of stages and one stage's keys are a subset of the one-stage module's.

Layers are built in DeepSpeed's order (the ``"parameters"`` method first builds every spec once to count
its parameters), so the same seed gives the same initial weights as DeepSpeed's ``PipelineModule``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsfunc.errors import InputError, InputTypeError
from dsfunc.pipeline.partition import partition

TIED_PREFIX = "tied_modules"


class LayerSpec:
    """A layer to build later, on the stage that holds it: ``typename(*args, **kwargs)``."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise InputTypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer sharing one module with every other layer of the same ``key``; ``forward_fn(module, x)``
    replaces its forward (the head that multiplies by the embedding's weight). Stages holding it keep a copy
    each; their gradients are summed, so the copies stay equal."""

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def layer_name(layer: Any) -> str:
    """The class name ``"type:<regex>"`` partitioning matches."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def stage_bounds(layers: Sequence[Any], stages: int, method: str) -> list[int]:
    """Where each stage's layers start and stop (builds every spec once for ``"parameters"``, as DeepSpeed)."""
    counts = [0] * len(layers)
    if method.lower() == "parameters":
        for i, layer in enumerate(layers):
            if isinstance(layer, LayerSpec):
                counts[i] = _trainable(layer.build())
            elif isinstance(layer, nn.Module):
                counts[i] = _trainable(layer)
    return partition(method, stages, [layer_name(x) for x in layers], counts)


def tied_stages(layers: Sequence[Any], bounds: Sequence[int]) -> dict[str, list[int]]:
    """Tie key -> the stages holding a layer of that key."""
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec):
            stage = next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1])
            out.setdefault(layer.key, [])
            if stage not in out[layer.key]:
                out[layer.key].append(stage)
    return out


class StageModule(nn.Module):
    """The layers of pipeline rank ``stage``: stage ``stage``'s (``bounds[stage]:bounds[stage + 1]``), or with
    ``stages_per_rank = v`` the ``v`` stages ``stage, stage + R, ..., stage + (v - 1) R`` of ``stages = v R``
    (an interleaved schedule's), run in that order."""

    def __init__(self, layers: Sequence[Any], *, stages: int = 1, stage: int = 0, stages_per_rank: int = 1,
                 partition_method: str = "parameters", loss_fn: Callable[..., torch.Tensor] | None = None,
                 activation_checkpoint_interval: int = 0, seed_layers: bool = False, base_seed: int = 1234,
                 seed_fn: Callable[[int], None] | None = None) -> None:
        super().__init__()
        layers = list(layers)
        if not layers:
            raise InputError("a pipeline needs at least one layer")
        if stages % stages_per_rank:
            raise InputError(f"{stages} pipeline stages do not split into {stages_per_rank} stages per rank")
        self.loss_fn = loss_fn
        self.num_stages, self.stage_id, self.stages_per_rank = stages, stage, stages_per_rank
        self.pipe_topology: Any = None  # the grid, when the module made it (DeepSpeed's PipelineModule)
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.parts = stage_bounds(layers, stages, partition_method)
        ranks = self.pipeline_ranks
        self.tied_stages = tied_stages(layers, self.parts)
        self.tied_ranks = {key: sorted({s % ranks for s in held}) for key, held in self.tied_stages.items()}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.held_stages = [stage + k * ranks for k in range(stages_per_rank)]
        self.chunk_funcs: list[list[Callable[[Any], Any]]] = []
        for held in self.held_stages:
            funcs = []
            for index in range(self.parts[held], self.parts[held + 1]):
                if seed_layers:
                    (seed_fn or _seed_all)(base_seed + index)
                funcs.append(self._build(index, layers[index]))
            self.chunk_funcs.append(funcs)
        self.forward_funcs = [f for funcs in self.chunk_funcs for f in funcs]

    @property
    def pipeline_ranks(self) -> int:
        """Ranks one replica of the pipeline spans."""
        return self.num_stages // self.stages_per_rank

    def chunks(self) -> list[nn.Module]:
        """One module per stage this rank holds (for the schedule's stages): views of this module's layers,
        not registered in it (the layers keep their names here)."""
        return [_Chunk(self, k) for k in range(len(self.held_stages))]

    def _build(self, index: int, layer: Any) -> Callable[[Any], Any]:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            return module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return layer
        if callable(layer):
            return layer
        raise InputTypeError(f"pipeline layer {index} is a {type(layer).__name__}: give an nn.Module, a "
                             "LayerSpec, a TiedLayerSpec or a callable")

    def unit_modules(self) -> list[str]:
        """The ZeRO units: each tied module, then each layer with parameters (the stages' lists, joined in stage
        order without repeats, are the one-stage module's: a checkpoint describes the whole model)."""
        own = [name for name, m in self._modules.items() if name != TIED_PREFIX and any(True for _ in m.parameters())]
        return [f"{TIED_PREFIX}.{key}" for key in self.tied_modules] + own

    def forward(self, *inputs: Any) -> Any:
        return self.run_chunk(self.forward_funcs, *inputs)

    def run_chunk(self, funcs: Sequence[Callable[[Any], Any]], *inputs: Any) -> Any:
        """``funcs`` in order on ``inputs`` (one tensor, or a tuple the first layer takes as it is), runs of
        ``activation_checkpoint_interval`` layers with parameters recomputed in backward."""
        x = inputs[0] if len(inputs) == 1 else inputs
        every = self.activation_checkpoint_interval
        if every <= 0 or not torch.is_grad_enabled():
            return _run(funcs, x)
        for start in range(0, len(funcs), every):
            chunk = funcs[start:start + every]
            if any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in chunk):
                x = checkpoint(_run, chunk, x, use_reentrant=False)
            else:
                x = _run(chunk, x)
        return x


class _Chunk(nn.Module):
    """One held stage of a :class:`StageModule`, as the module a ``PipelineStage`` runs."""

    def __init__(self, owner: StageModule, index: int) -> None:
        super().__init__()
        self.__dict__["owner"] = owner  # not a submodule: the layers are the owner's
        self.index = index

    def forward(self, *inputs: Any) -> Any:
        return self.owner.run_chunk(self.owner.chunk_funcs[self.index], *inputs)


def _run(funcs: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
