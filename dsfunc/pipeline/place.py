"""Where a pipelined model goes: this rank's stage module, the grid, and the :class:`Pipeline` of its program.

:func:`dsfunc.init_state` calls :func:`place` first: a model already split into stages (DeepSpeed's
``PipelineModule``) is used as it is; a layer list (``nn.Sequential``, or a list of modules, LayerSpecs,
TiedLayerSpecs and callables) is split by the config's ``pipeline`` section (or ``init_state(pipeline=...)``)
and this rank builds its own stage of it. Without stages there is nothing to place (an ordinary state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dsfunc.config import PipelineConfig, parse_pipeline
from dsfunc.config.config import pipeline_section
from dsfunc.distributed import comm
from dsfunc.distributed.mesh import Mesh, pipeline_mesh
from dsfunc.errors import InputError, InputTypeError
from dsfunc.pipeline.pipelined import Pipeline
from dsfunc.pipeline.stage import StageModule
from dsfunc.pipeline.topology import Topology, check_world, make_topology


@dataclasses.dataclass(frozen=True)
class Placement:
    """This rank's stage module and the pipeline its program runs; ``built``: the module was made here."""

    module: StageModule
    pipeline: Pipeline
    built: bool

    @property
    def mesh(self) -> Mesh:
        return self.pipeline.topology.mesh


def place(model: Any, config: Any, given: int | Mapping[str, Any] | PipelineConfig | None,
          loss_fn: Callable[..., torch.Tensor] | None, mesh: Mesh | DeviceMesh | None = None,
          device_type: str = "cpu") -> Placement | None:
    """This rank's stage of ``model`` (None: no pipeline) on the run's ``pp x dp x tp`` mesh (``mesh``, or the one the
    config describes). Every rank must call it (it creates groups).

    A ``PipelineModule`` is pipelined even with one stage, as in DeepSpeed (its engine's ``train_batch``)."""
    section = parse_pipeline(given) if given is not None else pipeline_section(config)
    if isinstance(model, StageModule) and (model.num_stages > 1 or model.pipe_topology is not None):
        # a PipelineModule made its grid: with one stage, data parallel over the stage's replicas
        if section.stages is not None and section.stages != model.num_stages:
            raise InputError(f"the pipeline config asks for {section.stages} stages but the PipelineModule was "
                             f"built with num_stages={model.num_stages}; make them agree (or drop the key)")
        module, built = model, False
        run_mesh = pipeline_mesh(module.pipeline_ranks, config, mesh, device_type)
    elif section.stages is None or section.stages == 1:
        return None
    else:
        layers = _layers(model)
        ranks = section.stages // section.stages_per_rank if section.stages % section.stages_per_rank == 0 else 0
        if not ranks:
            raise InputError(f"pipeline.stages ({section.stages}) must be a multiple of stages_per_rank "
                             f"({section.stages_per_rank})")
        check_world(ranks, comm.world_size())
        run_mesh = pipeline_mesh(ranks, config, mesh, device_type)
        module = StageModule(layers, stages=section.stages, stage=run_mesh.group("pp").rank,
                             stages_per_rank=section.stages_per_rank,
                             partition_method=section.partition_method, loss_fn=loss_fn,
                             activation_checkpoint_interval=section.activation_checkpoint_interval,
                             seed_layers=section.seed_layers)
        built = True
    loss = loss_fn or module.loss_fn
    if loss is None:
        raise InputError("a pipeline needs loss_fn(outputs, labels): pass loss_fn= to init_state (or to the "
                         "PipelineModule); the last stage applies it to its outputs and the batch's labels")
    topology = module.pipe_topology
    if topology is None or topology.mesh is not run_mesh:  # a PipelineModule's grid is pp x dp: split it over tp
        topology = make_topology(module.pipeline_ranks, module.tied_ranks, run_mesh)
    if topology.stage != module.stage_id:
        raise InputError(f"this rank built pipeline stage {module.stage_id} but the mesh places it at stage "
                         f"{topology.stage}: a pipeline's mesh has pp outermost")
    sync_tied(module, topology)
    return Placement(module, Pipeline(topology, section.schedule, loss), built)


@torch.no_grad()
def sync_tied(module: StageModule, topology: Topology) -> None:
    """Every stage's copy of a tied module takes the first holding stage's values (each stage built its own)."""
    for key, group in topology.tied_groups.items():
        if group is None:
            continue
        for t in [*module.tied_modules[key].parameters(), *module.tied_modules[key].buffers()]:
            if not t.is_meta:
                comm.broadcast(t.data, group)  # the group's ranks are in stage order: its first holds it first


def _layers(model: Any) -> list[Any]:
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, (list, tuple)):
        return list(model)
    raise InputTypeError(
        f"a pipeline splits a list of layers: pass an nn.Sequential, a list of layers (modules, "
        f"dsfunc.pipeline.LayerSpec, TiedLayerSpec, callables) or a PipelineModule, not a {type(model).__name__}"
    )
