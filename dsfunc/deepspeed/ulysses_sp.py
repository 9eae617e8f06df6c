"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ALST's tiled compute (``TiledMLP``,
``TiledFusedLogitsLoss``, ``sequence_tiled_compute``) with DeepSpeed's signatures, on :mod:`dsfunc.tiling`.

DeepSpeed's versions accumulate the weights' gradients into ``.grad`` inside their backward and need ZeRO
told when the last slice is done (``compute_params``, ``ds_grad_is_ready``); dsfunc's return them through the
graph (see [Note: gradients as outputs] in :mod:`dsfunc.tiling`), so ``compute_params`` only names the weights
a closure reads.

Its Ulysses pieces are shells over :mod:`dsfunc.parallel`: ``UlyssesSPAttentionHF.register_with_transformers``
builds the run's mesh with its sp axis (:mod:`dsfunc.distributed.mesh`), replaces the named attention function by
its Ulysses form (:func:`dsfunc.parallel.hf_attention.replace_attention`) and returns the groups object a script
passes to ``deepspeed.initialize(mpu=...)``; ``UlyssesSPDataLoaderAdapter`` is
:class:`dsfunc.parallel.sequence_data.SequenceShards`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dsfunc.distributed.comm import Group
from dsfunc.distributed.mesh import Mesh, make_mesh
from dsfunc.errors import InputError, unsupported
from dsfunc.parallel.hf_attention import check_config, replace_attention
from dsfunc.parallel.sequence_data import SequenceShards
from dsfunc.parallel.ulysses import check_heads, ulysses
from dsfunc.tiling import bind, tiled, tiled_closure, tiled_loss


class TiledMLP:
    """``TiledMLP.apply(fn, module, x, shards, compute_params)``: ``fn(module, x)`` a slice of the sequence
    (dim -2) at a time; every parameter of ``module`` that requires a gradient gets it."""

    @staticmethod
    def apply(fn: Callable[[torch.nn.Module, Tensor], Tensor], module: torch.nn.Module, x: Tensor, shards: int,
              compute_params: Sequence[Tensor] | None = None) -> Tensor:
        call, weights = bind(module, fn)
        return tiled(call, x, shards=shards, weights=weights, dim=-2)


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``: the
    mean (or sum) of ``fn(module, x_slice, y_slice[, mask_slice])`` over slices of the flattened batch and
    sequence, each slice's gradient taken as it is computed, as DeepSpeed's. The weights' gradients are scaled
    by the loss's incoming gradient as ``x``'s are (DeepSpeed's are not: they are right only when it is 1, e.g.
    not under a loss scale)."""

    @staticmethod
    def apply(fn: Callable[..., Tensor], module: torch.nn.Module, x: Tensor, y: Tensor, mask: Tensor | None,
              shards: int, compute_params: Sequence[Tensor] | None = None,
              output_reduction: str = "mean") -> Tensor:
        if output_reduction not in ("mean", "sum"):
            raise InputError(f'unknown output_reduction {output_reduction!r}: use "mean" or "sum"')
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise InputError(f"x and y must be [batch, seq, ...] of one batch and sequence, got {tuple(x.shape)} "
                             f"and {tuple(y.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise InputError(f"mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        call, weights = bind(module, fn)
        flat = [t.reshape(-1, *t.shape[2:]) for t in (x, y, mask) if t is not None]
        total = tiled_loss(call, *flat, shards=shards, weights=weights, dim=0)
        return total / len(torch.chunk(flat[0], shards)) if output_reduction == "mean" else total


def sequence_tiled_compute(fn: Callable[..., Tensor], seqlen: int, shards: int, kwargs_to_shard: Mapping[str, Tensor],
                           kwargs_to_pass: Mapping[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Sequence[Tensor] | None = None, output_unshard_dimension: int = 1,
                           output_reduction: str | None = "mean") -> Tensor:
    """``fn(**slices, **kwargs_to_pass)`` over slices of ``kwargs_to_shard`` along dim 1, its outputs joined
    along ``output_unshard_dimension`` (stacked along 0: a scalar per slice) and reduced as DeepSpeed's. Only
    ``kwargs_to_shard[grad_requiring_tensor_key]`` gets a gradient, and the weights ``fn`` reads must be listed in
    ``compute_params`` to get theirs (DeepSpeed without ZeRO finds them through ``.grad``; dsfunc returns them
    through the graph)."""
    if output_reduction not in (None, "mean", "sum"):
        raise InputError(f'unknown output_reduction {output_reduction!r}: use None, "mean" or "sum"')
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise InputError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of kwargs_to_shard's "
                         f"keys {sorted(kwargs_to_shard)}")
    keys = [grad_requiring_tensor_key, *(k for k in kwargs_to_shard if k != grad_requiring_tensor_key)]
    inputs = [kwargs_to_shard[keys[0]], *(kwargs_to_shard[k].detach() for k in keys[1:])]
    for k, v in zip(keys, inputs):
        if v.shape[1] != seqlen:
            raise InputError(f"kwargs_to_shard[{k!r}] has {v.shape[1]} positions along dim 1, not seqlen={seqlen}")

    def call(*parts: Tensor) -> Tensor:
        return fn(**dict(zip(keys, parts)), **kwargs_to_pass)

    weights = [p for p in compute_params or () if p.requires_grad]
    out = tiled_closure(call, *inputs, shards=shards, weights=weights, dim=1)
    if output_unshard_dimension != 1 and out.dim() > 1:
        raise InputError("output_unshard_dimension must be 1 (the sequence) or 0 (a scalar per slice), got "
                         f"{output_unshard_dimension}")
    if output_reduction == "mean":
        return out.mean()
    return out.sum() if output_reduction == "sum" else out


class SequenceTiledCompute:
    """DeepSpeed's autograd function behind :func:`sequence_tiled_compute`, with its positional order."""

    @staticmethod
    def apply(fn: Callable[..., Tensor], seqlen: int, shards: int, keys_to_shard: Sequence[str],
              keys_to_pass: Sequence[str], grad_requiring_tensor_key: str, compute_params: Sequence[Tensor] | None,
              output_unshard_dimension: int, output_reduction: str | None, *args: Any) -> Tensor:
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        return sequence_tiled_compute(fn, seqlen, shards, sharded, passed, grad_requiring_tensor_key, compute_params,
                                      output_unshard_dimension, output_reduction)


class SequenceParallelGroups:
    """The groups object ``register_with_transformers`` returns (DeepSpeed's ``parallel_state_sp``): the mesh's sp
    group, and its dp x sp group ZeRO reduces over. ``deepspeed.initialize(mpu=...)`` trains on its mesh."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def get_sequence_parallel_group(self) -> Any:
        return self.mesh.group("sp").process_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.size("sp")

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.group("sp").rank

    def get_sequence_data_parallel_group(self) -> Any:
        return self.mesh.zero.process_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.zero.size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.mesh.zero.rank

    def get_data_parallel_world_size(self) -> int:
        """The data-parallel replicas the config's batch sizes count."""
        return self.mesh.batch_ranks

    get_model_parallel_group = get_sequence_parallel_group  # as DeepSpeed's: sp is the one axis beside dp
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


class UlyssesSPAttentionHF(torch.nn.Module):
    """DeepSpeed's Ulysses attention for Hugging Face models: ``forward(module, q, k, v, attention_mask, ...)``
    with Hugging Face's ``[batch, heads, seq/sp, d]`` inputs. Shapes are not fixed in advance (dsfunc checks
    only that heads split), so ``batch_size``, ``seq_length_is_variable`` and the lengths are accepted and unused."""

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        group = Group.of(process_group)
        check_heads(attn_head_count, kv_head_count, group.size)
        self.attn, self.process_group, self.world_size, self.sp_rank = attn, process_group, group.size, group.rank
        self._forward = ulysses(attn, group, in_eval=not disable_in_eval)

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        return self._forward(module, query, key, value, attention_mask, *args, **kwargs)

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> SequenceParallelGroups | None:
        """Build the mesh with ``sequence_parallel_size`` sp ranks (a collective: every rank calls it), replace
        the attention function ``core_attn_implementation`` by its Ulysses form for every model of the process,
        and return the groups for ``deepspeed.initialize(mpu=...)``; None at size 1, as DeepSpeed."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise InputError("register_with_transformers: give seq_length, or seq_length_is_variable=True")
        if seq_length is not None and seq_length % sequence_parallel_size:
            raise InputError(f"seq_length {seq_length} does not split over sequence_parallel_size "
                             f"{sequence_parallel_size}: pad sequences to a multiple of it")
        config = _hf_config(model_name_or_path)
        given = getattr(config, "_attn_implementation", None)
        if given is not None and given != core_attn_implementation:
            raise InputError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                             f"attn_implementation='{given}'; set both to the same value")
        check_config(config, sequence_parallel_size)
        mesh = make_mesh(sp=sequence_parallel_size, device_type="cuda" if torch.cuda.is_available() else "cpu")
        replace_attention(core_attn_implementation, mesh.group("sp"), in_eval=not disable_in_eval)
        return SequenceParallelGroups(mesh)


def _hf_config(model_name_or_path: Any) -> Any:
    """The Hugging Face config of a model (or of anything with a ``config``: a PEFT model), or read from a path or
    hub name."""
    if hasattr(model_name_or_path, "config"):
        return model_name_or_path.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_name_or_path)


class UlyssesSPDataLoaderAdapter(SequenceShards):
    """``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)``: this rank's shards of the sp
    ranks' batches (input_ids, position_ids, shift_labels and the batch's other [batch, seq] tensors). A batch
    without position_ids gets ``arange(seq)`` (DeepSpeed's refuses it)."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        group = Group.of(sp_group)
        if (group.rank, group.size) != (sp_rank, sp_world_size):
            raise InputError(f"sp_rank {sp_rank} / sp_world_size {sp_world_size} are not this rank's place in "
                             f"sp_group (rank {group.rank} of {group.size})")
        super().__init__(dl, group, device)


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    return unsupported(f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name}", "Ulysses sequence parallelism")
