"""Where each parameter of a DeepSpeed checkpoint lies in its shard files, and reading pieces of it.

Every layout is reduced to one index: for each name (trainable parameter, frozen parameter, buffer) the
:class:`Piece` s that hold it, in order — which file, which flat tensor of that file, where in it, and
which elements of the flattened parameter. A read then opens the files one at a time and copies only the
pieces asked for ([Note: one shard at a time]). The layouts (``deepspeed/runtime``, 0.19):

* **stage 0** (``engine.py`` with a torch optimizer): the fp32 module is the master; the torch optimizer's
  ``state[i]`` belongs to the i-th parameter it was built with (``model.parameters()``: DeepSpeed records no
  names here).
* **stage 0, fp16/bf16** (``fp16/unfused_optimizer.py``): ``optimizer["fp32_groups"][g][j]`` is the master
  of the j-th trainable parameter of group g, its moments ``optimizer_state_dict["state"][k]`` (k counts
  along the groups).
* **ZeRO 1/2 and the bf16 optimizer** (``zero/stage_1_and_2.py``, ``bf16_optimizer.py``): each rank's
  ``single_partition_of_fp32_groups[g]`` and the moments of the same shape; ``param_slice_mappings[g]``
  gives each parameter's fragment (start, numel) in it. A parameter split over ranks has its fragments on
  consecutive ranks, in order.
* **ZeRO-3** (``zero/stage3.py``): every parameter is split over all ranks like ``torch.chunk``
  (``ceil(numel / W)`` per rank, padding at the end); rank r's ``fp32_flat_groups[g]`` is its chunk of
  each parameter of sub-group g (``param_shapes[g]``) back to back. Frozen parameters are chunked the same
  way in each rank's ``frozen_param_fragments``.

* **MoE experts** (:mod:`.experts`): stage 0 reads each expert's master from its own file and its moments from
  its expert-parallel rank's optimizer file; ZeRO 1-2 finds them in the shards under local names, renamed to
  the whole model's. The index is the whole model's, every expert of every rank.

Buffers and (below ZeRO-3) frozen parameters are read from the module state dict of the model-states file.
Tied parameters are one tensor saved under several names; the index keeps the first name and records the
others as aliases (two names are tied when they share storage and offset in the file).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.deepspeed.experts import (
    ExpertLayer,
    expert_layers,
    in_module_order,
    rank_experts,
    shard_renaming,
)
from dsfunc.checkpoint.deepspeed.folder import DeepSpeedFiles
from dsfunc.checkpoint.deepspeed.unpickle import load_file
from dsfunc.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointUnsupportedError,
)
from dsfunc.checkpoint.pickle_bounds import check_tensor
from dsfunc.experts.placement import is_expert_name
from dsfunc.zero.layout import chunk_range

MASTER, EXP_AVG, EXP_AVG_SQ = "fp32", "exp_avg", "exp_avg_sq"  # the quantities a piece can be read as
MOMENTS = (EXP_AVG, EXP_AVG_SQ)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[offset, offset + numel)`` of a flattened parameter, stored in ``path`` from ``start`` of
    the flat tensor ``key`` names (see :meth:`ShardIndex.tensor`): of the ``quantities`` named, or of all (None).
    A parameter whose master and moments lie in different files has a piece of each."""

    path: Path
    key: tuple[Hashable, ...]
    start: int
    numel: int
    offset: int
    quantities: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """Read elements ``[lo, hi)`` of the flattened ``name`` into ``views`` (quantity -> 1-D tensor of hi-lo)."""

    name: str
    lo: int
    hi: int
    views: Mapping[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """Every named tensor of a DeepSpeed checkpoint: its shape, aliases and pieces, and how to read them."""

    kind: str  # "stage0", "stage0-wrapped", "zero12" or "zero3"
    trainable: dict[str, torch.Size]  # parameters the optimizer trained (their fp32 master is kept), DS order
    frozen: dict[str, torch.Size]
    buffers: dict[str, tuple[torch.Size, torch.dtype]]
    aliases: dict[str, tuple[str, ...]]  # name -> every name of the tensor (tied weights), itself first
    names: tuple[str, ...]  # every name of the module's state dict, in its order
    pieces: dict[str, tuple[Piece, ...]]
    trust_pickle: bool
    main: Path  # the model-states file, unpickled once when the checkpoint was opened: ``main_contents``
    main_contents: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)

    def tensor(self, contents: Any, quantity: str, key: tuple[Hashable, ...]) -> torch.Tensor | None:
        """The flat tensor ``key`` names, read as ``quantity``, in an opened file (None: no such state)."""
        kind = key[0]
        if kind == "module":
            return contents["module"][key[1]] if quantity == MASTER else None
        if kind == "frozen":
            return contents["frozen_param_fragments"][key[1]] if quantity == MASTER else None
        if kind == "expert":  # a file of one expert's weights (:mod:`.experts`)
            return contents[key[1]] if quantity == MASTER else None
        if kind == "stage0":
            _, name, index = key
            if quantity == MASTER:
                return contents["module"][name]
            return contents["optimizer"]["state"].get(index, {}).get(quantity)
        if kind == "wrapped":
            _, group, j, index = key
            opt = contents["optimizer"]
            if quantity == MASTER:
                return opt["fp32_groups"][group][j]
            return opt["optimizer_state_dict"]["state"].get(index, {}).get(quantity)
        osd, group = contents["optimizer_state_dict"], key[1]
        if quantity == MASTER:
            return osd["single_partition_of_fp32_groups" if kind == "zero12" else "fp32_flat_groups"][group]
        base = osd["base_optimizer_state"] if kind == "zero12" else osd["optimizer_state_dict"]
        state = base[group] if isinstance(base, list) else base["state"].get(group, {})
        return state.get(quantity)

    def read(self, requests: Iterable[Request]) -> None:
        """Fill every request's views from the shard files, opening each file once, one at a time.

        [Note: one shard at a time]
        The requests are grouped by the file their pieces lie in; each file is opened (memory-mapped), the
        pieces copied out of it, and the file released before the next is opened, so no more than one
        shard is mapped at once (besides the model states, unpickled once when the checkpoint was opened)
        and only the pages of the pieces asked for are touched. A quantity a file has no state for (a
        parameter the optimizer never stepped) is read as zeros.
        """
        jobs: dict[Path, list[tuple[Request, Piece]]] = {}
        for req in requests:
            for piece in self.pieces[req.name]:
                if piece.offset < req.hi and req.lo < piece.offset + piece.numel:
                    jobs.setdefault(piece.path, []).append((req, piece))
        for path, work in jobs.items():
            contents = self.main_contents if path == self.main else load_file(path, trust_pickle=self.trust_pickle)
            for req, piece in work:
                a, b = max(req.lo, piece.offset), min(req.hi, piece.offset + piece.numel)
                for quantity, view in req.views.items():
                    if piece.quantities is not None and quantity not in piece.quantities:
                        continue
                    source = self.tensor(contents, quantity, piece.key)
                    target = view[a - req.lo : b - req.lo]
                    if source is None:
                        target.zero_()
                    else:
                        begin = piece.start + a - piece.offset
                        target.copy_(check_tensor(source, path).reshape(-1)[begin : begin + (b - a)])
            del contents


def build_index(files: DeepSpeedFiles, main: Mapping[str, Any], *, frozen_hint: Iterable[str] | None,
                trust_pickle: bool) -> tuple[ShardIndex, Mapping[str, Any] | None]:
    """The index of the checkpoint whose rank-0 model states are ``main`` (already opened), and rank 0's
    optimizer state dict (None without optimizer-states files), each file unpickled once.

    ``frozen_hint`` names the parameters that did not train, where the layout does not record it (stage 0
    with fp16/bf16); without it such a checkpoint must have no frozen parameters.
    """
    module = main["module"]
    buffer_names = list(main.get("buffer_names") or [])
    layers = expert_layers(files, main, trust_pickle)
    aliases = _aliases(module, buffer_names)
    buffers = {n: (module[n].shape, module[n].dtype) for n in buffer_names if n in module}
    params = [n for n in aliases if n not in buffers]
    hint = set(frozen_hint or ())
    first = None
    if files.optim_states:
        kind, trainable, pieces, first = _sharded(files, main, trust_pickle, layers)
    elif isinstance(main.get("optimizer"), Mapping) and "fp32_groups" in main["optimizer"]:
        kind = "stage0-wrapped"
        if layers:
            raise CheckpointUnsupportedError(
                f"{files.main}: DeepSpeed's fp16 optimizer at ZeRO stage 0 with MoE experts, whose master weights "
                "dsfunc does not import; resume it in DeepSpeed at ZeRO stage 1 or 2 and save again, or load it "
                "in fp32.")
        trainable, pieces = _wrapped(files.main, main, params, hint)
    elif isinstance(main.get("optimizer"), Mapping) and "fp32_groups_flat" in main["optimizer"]:
        raise CheckpointUnsupportedError(
            f"{files.main}: DeepSpeed's fused fp16 optimizer (stage 0 with FusedAdam) keeps its fp32 master "
            "weights in flat groups without parameter names; dsfunc does not import that layout. Resume it "
            "in DeepSpeed with ZeRO stage 1 or higher (or torch_adam) and save again.")
    elif layers:
        kind = "stage0"
        trainable, pieces = _stage0_experts(files, main, params, hint, layers, trust_pickle)
    else:
        kind = "stage0"
        trainable, pieces = _stage0(files.main, main, params, hint)
    frozen = {n: module[n].shape for n in params if n not in trainable}
    if kind == "zero3":
        if layers:
            raise CheckpointUnsupportedError(f"{files.folder}: MoE experts at ZeRO stage 3, which DeepSpeed's own "
                                             "MoE refuses; this checkpoint was not written by DeepSpeed's MoE layer")
        frozen = dict(main.get("frozen_param_shapes") or {})
        pieces.update(_chunked(files.model_states, [(n, s, ("frozen", n), 0) for n, s in frozen.items()]))
    for name in [*buffers, *([] if kind == "zero3" else frozen)]:
        pieces[name] = (Piece(files.main, ("module", name), 0, module[name].numel(), 0),)
    for layer in layers:  # an expert's weights are its master (fp32) or its values (frozen)
        for name, (shape, path) in layer.params.items():
            if name not in trainable:
                frozen[name] = shape
                pieces[name] = (Piece(path, ("expert", name), 0, math.prod(shape), 0),)
    order = in_module_order(aliases, layers)
    aliases = {n: aliases.get(n, (n,)) for n in order}
    names = tuple(in_module_order(module, layers))
    trainable = {n: trainable[n] for n in order if n in trainable} if layers else trainable
    index = ShardIndex(kind, trainable, frozen, buffers, aliases, names,
                       {n: tuple(p) for n, p in pieces.items()}, trust_pickle, files.main, main)
    check_coverage(files.folder, index)
    return index, first


def _aliases(module: Mapping[str, torch.Tensor], buffer_names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each tensor's first name -> all its names, in the module's order (tied names share storage+offset)."""
    first: dict[tuple[int, int], str] = {}
    out: dict[str, list[str]] = {}
    for name, t in module.items():
        place = (t.untyped_storage()._cdata, t.storage_offset())
        if name in buffer_names or place not in first:
            first.setdefault(place, name)
            out[name] = [name]
        else:
            out[first[place]].append(name)
    return {n: tuple(a) for n, a in out.items()}


def _stage0(path: Path, main: Mapping[str, Any], params: list[str],
            frozen_hint: set[str]) -> tuple[dict, dict]:
    """A torch optimizer over the fp32 module (stage 0 in fp32): its i-th entry is the i-th parameter."""
    opt = main.get("optimizer") or {}
    indices = [i for group in opt.get("param_groups", []) for i in group["params"]]
    module = main["module"]
    names = _optimizer_order(path, len(indices), params, frozen_hint) if indices else params
    index = dict(zip(names, indices))
    trainable = {n: module[n].shape for n in names}
    pieces = {n: [Piece(path, ("stage0", n, index.get(n)), 0, module[n].numel(), 0)] for n in names}
    return trainable, pieces


def _stage0_experts(files: DeepSpeedFiles, main: Mapping[str, Any], params: list[str], frozen_hint: set[str],
                    layers: Sequence[ExpertLayer], trust_pickle: bool) -> tuple[dict, dict]:
    """Stage 0 with MoE experts (:mod:`.experts`): the dense parameters as without experts, read from the model
    states (rank 0's optimizer); each expert's master from its file and its moments from its expert-parallel
    rank's optimizer file, whose ``moe`` groups hold that rank's experts in module order."""
    if not files.expert_optim_states:
        raise CheckpointCorruptError(
            f"{files.folder} holds the experts of a ZeRO stage 0 run but none of the optimizer files of its "
            "expert-parallel ranks (expp_rank_<q>_mp_rank_00_optim_states.pt): it is incomplete")
    ep = len(files.expert_optim_states)
    trainable, pieces = {}, {}
    for rank, path in enumerate(files.expert_optim_states):
        opt = load_file(path, trust_pickle=trust_pickle).get("optimizer") or {}
        entries = [(bool(group.get("moe")), i) for group in opt.get("param_groups", []) for i in group["params"]]
        dense = iter(_optimizer_order(path, sum(not moe for moe, _ in entries), params, frozen_hint))
        mine = rank_experts(layers, rank, ep)
        if sum(moe for moe, _ in entries) != len(mine):
            raise CheckpointMismatchError(
                f"{path}: expert-parallel rank {rank}'s optimizer holds {sum(moe for moe, _ in entries)} expert "
                f"parameters, but its experts' files {len(mine)}: its MoE param groups were not made by "
                "split_params_into_different_moe_groups_for_optimizer from the model's parameters in order, which "
                "dsfunc reads the experts' moments by (DeepSpeed records no names at stage 0). Convert it with "
                "DeepSpeed's zero_to_fp32.py, or resume it in DeepSpeed at ZeRO stage 1 or 2 and save again.")
        experts = iter(mine)
        for moe, i in entries:
            name = next(experts if moe else dense)
            if moe:
                shape, source = next(layer.params[name] for layer in layers if name in layer.params)
                numel = math.prod(shape)
                pieces[name] = [Piece(source, ("expert", name), 0, numel, 0, (MASTER,)),
                                Piece(path, ("stage0", name, i), 0, numel, 0, MOMENTS)]
            elif rank == 0:  # the model states hold rank 0's optimizer, the dense master weights with it
                shape = main["module"][name].shape
                pieces[name] = [Piece(files.main, ("stage0", name, i), 0, math.prod(shape), 0)]
            else:
                continue
            moment = opt.get("state", {}).get(i, {}).get(EXP_AVG)
            if moment is not None and moment.shape != shape:
                raise CheckpointMismatchError(
                    f"{path}: the optimizer's parameter {i} has moments of shape {tuple(moment.shape)} but "
                    f"{name} is {tuple(shape)}: the optimizer was not built from the model's parameters in order")
            trainable[name] = shape
    return trainable, pieces


def _wrapped(path: Path, main: Mapping[str, Any], params: list[str], frozen_hint: set[str]) -> tuple[dict, dict]:
    """DeepSpeed's unfused fp16/bf16 optimizer at stage 0: per-parameter fp32 masters of trainable params."""
    module, groups = main["module"], main["optimizer"]["fp32_groups"]
    entries = [(g, j) for g, group in enumerate(groups) for j in range(len(group))]
    trainable, pieces = {}, {}
    for k, ((g, j), name) in enumerate(zip(entries, _optimizer_order(path, len(entries), params, frozen_hint))):
        master = groups[g][j]
        if master.shape != module[name].shape:
            raise CheckpointMismatchError(
                f"{path}: fp32 master weight {k} has shape {tuple(master.shape)} but parameter {name} "
                f"{tuple(module[name].shape)}: the optimizer was not built from model.parameters() in order")
        trainable[name] = module[name].shape
        pieces[name] = [Piece(path, ("wrapped", g, j, k), 0, master.numel(), 0)]
    return trainable, pieces


def _optimizer_order(path: Path, count: int, params: list[str], frozen_hint: set[str]) -> list[str]:
    """The parameter names of a stage-0 optimizer's ``count`` entries: all parameters, or the trainable ones.

    DeepSpeed records no names at stage 0; its optimizer was built from ``model.parameters()`` (in module
    order), with or without the frozen ones.
    """
    if count == len(params):
        return params
    trainable = [n for n in params if n not in frozen_hint]
    if count == len(trainable) and frozen_hint:
        return trainable
    raise CheckpointMismatchError(
        f"{path}: the optimizer holds {count} parameters but the module {len(params)}"
        + (f" ({len(trainable)} trainable)" if frozen_hint else "")
        + "; DeepSpeed records no parameter names at stage 0, so dsfunc imports only an optimizer built from "
        "model.parameters(). Load it into a state built from the same model (which tells frozen parameters "
        "apart), or pass load_optimizer_states=False to take the weights only.")


def _sharded(files: DeepSpeedFiles, main: Mapping[str, Any], trust_pickle: bool,
             layers: Sequence[ExpertLayer]) -> tuple[str, dict, dict, Any]:
    """ZeRO 1-3 and the bf16 optimizer: the pieces of every trainable parameter in the optimizer files (an
    expert's under its whole-model name, :mod:`.experts`), and the first file's optimizer state dict."""
    world = len(files.optim_states)
    experts = {n: shape for layer in layers for n, (shape, _) in layer.params.items()}
    shapes = {n: torch.Size(s) for group in main.get("param_shapes") or [] for n, s in group.items()
              if not is_expert_name(n)}  # an expert's under its local name on rank 0: from its file instead
    kind, pieces, filled, first = None, {}, {}, None
    for rank, path in enumerate(files.optim_states):  # [Note: one shard at a time]
        osd = load_file(path, trust_pickle=trust_pickle)["optimizer_state_dict"]
        first = osd if first is None else first
        counts = osd.get("partition_count")
        count = max(counts) if isinstance(counts, list) else counts
        if count != world:
            raise CheckpointCorruptError(
                f"{path} was written by one of {count} data-parallel ranks, but {files.folder} holds {world} "
                "optimizer-states files: some are missing")
        kind = "zero3" if "fp32_flat_groups" in osd else "zero12"
        if kind == "zero3":
            _check_zero3_sizes(path, osd, main["param_shapes"], world)
            continue
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            partitions = counts[g] if isinstance(counts, list) else world
            rename = shard_renaming(layers, main.get("ds_config"), rank, world, partitions) if layers else str
            for local, fragment in mapping.items():
                name = rename(local)
                offset = filled.get(name, 0)
                pieces.setdefault(name, []).append(Piece(path, ("zero12", g), fragment.start, fragment.numel, offset))
                filled[name] = offset + fragment.numel
        del osd
    if kind == "zero3":
        layout = []
        for g, group in enumerate(main["param_shapes"]):
            start = 0
            for name, shape in group.items():
                layout.append((name, shape, ("zero3", g), start))
                start += chunk_range(math.prod(shape), world, 0)[1]
        pieces = _chunked(files.optim_states, layout)
    if not shapes:  # the bf16 optimizer without ZeRO records no param_shapes: the module has them
        shapes = {n: main["module"][n].shape for n in pieces if n not in experts}
    shapes.update({n: experts[n] for n in pieces if n in experts})
    return kind, shapes, pieces, first


def _check_zero3_sizes(path: Path, osd: Mapping[str, Any], groups: Sequence[Mapping[str, Any]],
                       world: int) -> None:
    flats = osd["fp32_flat_groups"]
    expected = [sum(chunk_range(math.prod(s), world, 0)[1] for s in group.values()) for group in groups]
    if [int(f.numel()) for f in flats] != expected:
        raise CheckpointCorruptError(
            f"{path}: its fp32 partitions hold {[int(f.numel()) for f in flats]} elements, but the parameter "
            f"shapes recorded in the model states need {expected} per rank of {world}")


def _chunked(paths: Sequence[Path], layout: Iterable[tuple[str, Any, tuple, int]]) -> dict[str, list[Piece]]:
    """Pieces of tensors split over ``paths`` like ``torch.chunk`` (ZeRO-3): ``(name, shape, key, start)``."""
    pieces = {}
    for name, shape, key, start in layout:
        numel = math.prod(shape)
        out = []
        for r, path in enumerate(paths):
            lo, hi = chunk_range(numel, len(paths), r)
            if hi > lo:
                out.append(Piece(path, key, start, hi - lo, lo))
        pieces[name] = out
    return pieces


def check_coverage(folder: Path, index: ShardIndex) -> None:
    """Every tensor's pieces of its master weights (or values) cover it exactly, in order."""
    shapes = {**index.trainable, **index.frozen, **{n: s for n, (s, _) in index.buffers.items()}}
    for name, shape in shapes.items():
        offset = 0
        for piece in index.pieces.get(name, ()):
            if piece.quantities is not None and MASTER not in piece.quantities:
                continue
            if piece.offset != offset:
                break
            offset += piece.numel
        if offset != math.prod(shape):
            raise CheckpointCorruptError(
                f"the DeepSpeed checkpoint {folder} holds {offset} of the {math.prod(shape)} elements of "
                f"{name} {tuple(shape)}: its shard files do not fit together")
