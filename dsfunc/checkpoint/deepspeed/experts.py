"""DeepSpeed's MoE checkpoints: the experts of its ``MoE`` layers, saved one file per expert and sharded under
each expert-parallel rank's local names, named as in the whole model so that :mod:`.shards` indexes them.

DeepSpeed's engine (``_save_moe_checkpoint`` and ``load_moe_state_dict`` in ``runtime/engine.py``, 0.19.8) saves a
model with ``MoE`` layers as:

* the model states, whose module leaves the experts out;
* ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt``: expert e of the l-th MoE layer (in module order), its module
  weights under their whole-model names (``<layer>.deepspeed_moe.experts.deepspeed_experts.<e>.<rest>``);
* at ZeRO stage 0, ``expp_rank_<q>_mp_rank_00_optim_states.pt``: expert-parallel rank q's torch optimizer
  (``{"optimizer": state_dict}``) over the param groups ``split_params_into_different_moe_groups_for_optimizer``
  made: the dense parameters, then (groups marked ``moe``) the rank's own experts;
* at ZeRO 1-2, each rank's optimizer shard as without experts, its expert groups partitioned over the rank's
  expert-data-parallel ranks (their ``partition_count``) under the *local* names of its expert-parallel rank.

At ep P, ep rank q's local expert i of a layer of E experts is the model's expert ``q * E / P + i``
(:func:`dsfunc.experts.placement.whole_expert_name`). DeepSpeed's groups (``utils/groups.py``) put global rank r at
ep rank ``r % P``, expert-data-parallel rank ``r // P`` (with ``use_data_before_expert_parallelism``: ``r // D`` and
``r % D``, D = W / P), so ranks in order hold each expert's fragments in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.deepspeed.folder import DeepSpeedFiles
from dsfunc.checkpoint.deepspeed.unpickle import load_file
from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointUnsupportedError
from dsfunc.experts.placement import is_expert_name, split_expert_name, whole_expert_name


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's experts as saved: each parameter's whole-model name, shape and file, expert by expert."""

    experts: str  # the path of the layer's experts module (``<layer>.deepspeed_moe.experts``)
    count: int
    params: dict[str, tuple[torch.Size, Path]]

    @property
    def gate(self) -> str:
        """The gate's weight, which the experts follow in the module's order."""
        return f"{self.experts.removesuffix('.experts')}.gate.wg.weight"

    def of_rank(self, rank: int, ep: int) -> list[str]:
        """The names of ep rank ``rank``'s experts, in its module's order."""
        local = self.count // ep
        return [n for n in self.params if rank * local <= split_expert_name(n)[1] < (rank + 1) * local]


def expert_layers(files: DeepSpeedFiles, main: Mapping[str, Any], trust_pickle: bool) -> tuple[ExpertLayer, ...]:
    """The MoE layers of the checkpoint ``files`` (``main``: its model states), each expert file opened once."""
    if main.get("ds_autoep_layers"):
        raise CheckpointUnsupportedError(
            f"{files.main} was saved by DeepSpeed's AutoEP (ds_autoep_layers), whose expert layout dsfunc does not "
            "import; dsfunc imports the experts of deepspeed.moe.layer.MoE. Export the weights with DeepSpeed's "
            "zero_to_fp32.py, or train the model under dsfunc's AutoEP from the start.")
    layers = []
    for number, paths in enumerate(files.experts):
        params: dict[str, tuple[torch.Size, Path]] = {}
        modules = set()
        for expert, path in enumerate(paths):
            contents = load_file(path, trust_pickle=trust_pickle)
            if not isinstance(contents, Mapping) or not contents:
                raise CheckpointCorruptError(f"{path} is not a DeepSpeed expert file (a dict of one expert's weights)")
            for name, tensor in contents.items():
                try:
                    module, index, _ = split_expert_name(name)
                except ValueError as e:
                    raise CheckpointCorruptError(f"{path}: {e}") from e
                if index != expert or not isinstance(tensor, torch.Tensor):
                    raise CheckpointCorruptError(f"{path} holds {name}, which is no weight of expert {expert}")
                modules.add(module)
                params[name] = (tensor.shape, path)
            del contents
        if len(modules) != 1:
            raise CheckpointCorruptError(f"the expert files of MoE layer {number} in {files.folder} hold the experts "
                                         f"of {sorted(modules)}, not of one layer")
        layers.append(ExpertLayer(modules.pop(), len(paths), params))
    saved = main.get("num_experts")
    if isinstance(saved, list) and saved != [layer.count for layer in layers]:
        raise CheckpointCorruptError(
            f"{files.main} records MoE layers of {saved} experts, but {files.folder} holds the files of "
            f"{[layer.count for layer in layers]}: some expert files are missing")
    return tuple(layers)


def rank_experts(layers: Iterable[ExpertLayer], rank: int, ep: int) -> list[str]:
    """The whole-model names of ep rank ``rank``'s expert parameters, in the order of its module (and of its
    optimizer's ``moe`` group)."""
    return [name for layer in layers for name in layer.of_rank(rank, ep)]


def shard_renaming(layers: Iterable[ExpertLayer], config: Any, rank: int, world: int,
                   partitions: int) -> Callable[[str], str]:
    """The whole-model name of a parameter of global rank ``rank``'s ZeRO shard (of ``world``), in a group
    partitioned over ``partitions`` ranks: an expert's local name is renamed to its place in the model."""
    counts = {layer.experts: layer.count for layer in layers}
    ep = world // partitions
    data_first = isinstance(config, Mapping) and bool(config.get("use_data_before_expert_parallelism"))
    ep_rank = rank // partitions if data_first else rank % ep

    def rename(name: str) -> str:
        if not is_expert_name(name):
            return name
        experts = split_expert_name(name)[0]
        if experts not in counts or counts[experts] % ep:
            raise CheckpointCorruptError(
                f"the optimizer shard of rank {rank} holds {name}, an expert of {experts}, which has "
                f"{counts.get(experts, 'no')} expert files for {ep} expert-parallel ranks")
        return whole_expert_name(name, ep_rank, counts[experts] // ep)

    return rename


def in_module_order(names: Iterable[str], layers: Iterable[ExpertLayer]) -> list[str]:
    """``names`` (the saved module's, which leaves the experts out) with each layer's experts after its gate,
    where DeepSpeed's ``MoE`` registers them."""
    after = {layer.gate: list(layer.params) for layer in layers}
    out = []
    for name in names:
        out.append(name)
        out += after.pop(name, [])
    return out + [n for rest in after.values() for n in rest]
