"""Muon (Keller Jordan, 2024): momentum orthogonalised by a Newton-Schulz iteration, for hidden weight matrices,
with Adam for every other parameter (embeddings, the LM head, norms, biases), as DeepSpeed's ``"type": "Muon"``.

The math is DeepSpeed's ``muon_update`` (``deepspeed/runtime/zero/muon/original_muon.py``)::

    m = m.lerp(g, 1 - momentum)                      # an EMA of the gradients (not torch SGD's m * mu + g)
    u = g.lerp(m, momentum) if nesterov else m       # nesterov: DeepSpeed's default
    u = newton_schulz(u) * sqrt(max(1, rows / cols))
    p = p * (1 - lr * weight_decay) - lr * u

and the Adam half is DeepSpeed's ``adam_update`` with decoupled decay (Muon's Adam defaults: betas (0.9, 0.95),
eps 1e-10). Which parameters take Muon is DeepSpeed's rule (:func:`takes_muon`): at least 2-D and named neither
``embed`` nor ``lm_head``.

Newton-Schulz is DeepSpeed's, operation for operation: ``ns_method: "gram"`` (DeepSpeed's default) iterates on
the Gram matrix in fp16, ``"standard"`` runs the quintic in bf16, each in fp32 where the device lacks that dtype
(:func:`ns_dtype`); the aspect scale is taken from the parameter's last two dims (a conv filter's kernel dims, as
DeepSpeed and Keller Jordan do). DeepSpeed ``torch.compile``s ``muon_update`` and its Newton-Schulz functions
(inductor, torch's defaults, on every accelerator, the CPU too): fused elementwise ops round once where eager
ones round at each op, which half-precision Newton-Schulz carries on (on a 20x48 matrix on the CPU, compiled and
eager differ by 1% of the largest entry in fp16, 6% in bf16). dsfunc orthogonalises the matrices of one shape
together, stacked (:func:`orthogonalize_all`), and compiles that Newton-Schulz, aspect scale and cast (the part of
``muon_update`` after the momentum) where the matrices are on a GPU, where eager Newton-Schulz is bound by its
~60 kernel launches a call, and runs it eagerly elsewhere (on the CPU inductor's first compile of each shape takes
longer than the step). Eager, an update is DeepSpeed's eager ``muon_update`` bit for bit on the CPU, where
torch's batched matmul computes each matrix as its 2-D matmul does (tested; a GPU's BLAS may pick another kernel
for a batch). Compiled, it is within the compiled rounding of DeepSpeed's compiled ``muon_update``, not bit for
bit: inductor fuses a 2-D matmul and the add after it into one ``addmm`` (one rounding) but not a batched one
(two), and every matrix, one alone too, goes through the batched iteration (on 48x20 matrices on the CPU: 0.7% of
the largest entry in fp16, 6% in bf16, as large as DeepSpeed's own compiled against eager). dsfunc's momentum EMA
stays eager (DeepSpeed's compiled one differs in the last bits of fp32). ``TORCHDYNAMO_DISABLE=1``
makes both eager.

Where dsfunc differs from DeepSpeed otherwise: the dtype follows the device the matrix is on (DeepSpeed's: its
accelerator's). DeepSpeed keeps the momentum out of a step whose gradient overflowed (and its 0.19.8 fails on 4-D
filters there); dsfunc's loss scaler skips such a step before the optimizer sees it. A parameter group's
``use_muon`` overrides the name rule (:func:`muon_groups`). Clipping scales the gradients Muon's momentum takes in,
at every stage, as DeepSpeed's stage 0 does; its ZeRO 1-3 take the global norm over Muon's orthogonalised update
and clip that.

[Note: whole matrices under ZeRO] A unit's flat buffer is split over ranks wherever the split falls, so a
matrix may straddle two ranks' shards, and Newton-Schulz needs the whole matrix. DeepSpeed all-reduces the full
gradient of such a matrix and keeps a whole momentum buffer for every matrix that touches a rank's partition
(the straddling ones on both ranks). dsfunc keeps the momentum sharded exactly like the master weights: the
momentum step and the nesterov blend are elementwise, so each rank makes its shard of the blend, the blend of a
Muon unit is all-gathered (one collective per unit, of the unit's size in fp32), and each rank orthogonalises
only the matrices that overlap its shard and keeps its slice. A straddling matrix is orthogonalised on both of
its ranks, from the same gathered values, so both slices come from one result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from dsfunc.errors import InputError
from dsfunc.optim.aliases import adam
from dsfunc.optim.base import (
    Params,
    ScalarOrSchedule,
    Transform,
    Updates,
    _check,
    _map,
    named_chain,
)
from dsfunc.optim.groups import ParamGroups
from dsfunc.optim.transforms import add_decayed_weights, scale_by_learning_rate

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c), DeepSpeed's and Keller Jordan's
NO_MUON_NAMES = ("embed", "lm_head")  # DeepSpeed's set_optimizer_flags: these matrices take Adam
GRAM_RESTART = 2  # the Gram iteration's restart step, DeepSpeed's


def takes_muon(name: str, shape: tuple[int, ...]) -> bool:
    """DeepSpeed's rule for which parameters Muon updates: matrices (2-D or more) whose name contains neither
    ``embed`` nor ``lm_head`` (case-insensitive); the rest take Adam."""
    return len(shape) >= 2 and not any(word in name.lower() for word in NO_MUON_NAMES)


@functools.cache
def ns_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz runs in on ``device``, DeepSpeed's ``ns_compute_dtype``: fp16 for ``"gram"``, bf16
    for ``"standard"``, fp32 where the device lacks that dtype (CUDA: bf16 as torch reports it, fp16 from
    compute capability 7; CPU: bf16 always, fp16 where oneDNN has it; other devices: fp32). Cached: asked once
    a matrix a step."""
    half = torch.float16 if method == "gram" else torch.bfloat16
    return half if _has(half, device) else torch.float32


def _has(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported() if dtype == torch.bfloat16 else torch.cuda.get_device_capability(
            device)[0] >= 7
    if device.type == "cpu":
        return dtype == torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def _quintic(x: Tensor, steps: int) -> Tensor:
    """``steps`` quintic iterations ``X = a X + (b A + c A A) X`` with ``A = X X^T`` on a wide ``x``."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x


def newton_schulz(g: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """The orthogonal factor of ``g`` (its last two dims; leading dims are a batch), approximately, as
    DeepSpeed's ``zeropower_via_newtonschulz5``: cast to ``dtype``, the wide orientation, Frobenius
    normalisation, then :func:`_quintic`, all in ``dtype``."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = _quintic(x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7), steps)
    return x.mT if tall else x


def gram_newton_schulz(g: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """:func:`newton_schulz` iterated on the small Gram matrix ``R = X X^T`` (Tri Dao's arrangement, fewer
    flops for a wide ``X``), as DeepSpeed's ``zeropower_via_gram_newtonschulz``: normalised in ``g``'s dtype
    (fp32 for an fp16 ``g``, whose range a scaled gradient may exceed), then cast to ``dtype``; the
    iteration accumulates ``Q`` with ``X = Q X`` at the end and restarts from ``X = Q X`` at step
    ``GRAM_RESTART`` to keep half precision stable. A square matrix takes the plain quintic."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.float32 if g.dtype == torch.float16 else g.dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    if x.size(-1) <= x.size(-2):
        x = _quintic(x, steps)
        return x.mT if tall else x
    R, Q = x @ x.mT, None
    for i in range(steps):
        if i == GRAM_RESTART:
            x = Q @ x
            R, Q = x @ x.mT, None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and i + 1 != GRAM_RESTART:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return x.mT @ Q.mT if tall else Q @ x


NS_METHODS = {"gram": gram_newton_schulz, "standard": newton_schulz}


MAX_BATCH_ELEMENTS = 2**28  # one stacked Newton-Schulz call's elements at most (see orthogonalize_all)


def orthogonalize(u: Tensor, steps: int = 5, method: str = "gram", compiled: bool | None = None) -> Tensor:
    """Muon's update for one parameter's blended momentum ``u``, as DeepSpeed's ``muon_update``: ``method``'s
    Newton-Schulz (a 4-D conv filter as ``(out, -1)``) in :func:`ns_dtype`, times ``sqrt(max(1, rows /
    cols))`` of ``u``'s last two dims, in ``u``'s shape and dtype; ``torch.compile``d where ``compiled`` (by
    default where ``u`` is on a GPU; see the module's docstring). Several at once: :func:`orthogonalize_all`."""
    return next(orthogonalize_all([u], steps, method, compiled))[1]


def orthogonalize_all(
    us: Sequence[Tensor],
    steps: int = 5,
    method: str = "gram",
    compiled: bool | None = None,
    max_elements: int = MAX_BATCH_ELEMENTS,
) -> Iterator[tuple[int, Tensor]]:
    """:func:`orthogonalize` of every tensor of ``us``, yielded as ``(index in us, update)``, batch by batch:
    the tensors of one shape, dtype and device are stacked and orthogonalised in one call (Newton-Schulz takes
    leading dims as a batch), as many calls as :func:`stacks` makes.

    Why: one matrix's Newton-Schulz is ~60 kernels, GEMMs and elementwise ops on Gram-sized tensors; one call per
    matrix, their launches and the small kernels are much of Muon's cost on a GPU (GPT 1.3b on an H100: ~150 ms a
    step where the GEMMs' FLOPs take ~70), while a stacked call does every matrix of a shape with the same
    launches (1.3b: 96 matrices of 4 shapes, 7 calls). What it costs: a stack is a transient copy of its
    matrices, and Newton-Schulz's working tensors are the stack's size where one matrix's were its own;
    :data:`MAX_BATCH_ELEMENTS` (2**28) caps a stack at 1 GiB in fp32, about 3 GiB with Newton-Schulz's
    half-precision copies and the fp32 result (1.3b: 12 [8192, 2048] matrices, 2.3 GiB, where one took 0.2), a
    size far past where the GEMMs fill an H100. A caller that stores each update as it comes keeps one stack
    alive at a time.
    Eager on the CPU, a matrix's update is the same bit for bit, stacked with others or alone; compiled, within
    rounding (see the module's docstring).
    """
    for batch in stacks(us, max_elements):
        first = us[batch[0]]
        run = _compiled() if (first.device.type == "cuda" if compiled is None else compiled) else _orthogonalize
        stack = first[None] if len(batch) == 1 else torch.stack([us[i] for i in batch])
        yield from zip(batch, run(stack, steps, method, ns_dtype(method, first.device)).unbind(0))


def stacks(us: Sequence[Tensor], max_elements: int = MAX_BATCH_ELEMENTS) -> list[list[int]]:
    """The indices of ``us`` that :func:`orthogonalize_all` stacks together: those of one shape, dtype and device,
    in the order of ``us``, split into as few batches of at most ``max_elements`` elements as can be (at least
    one tensor each), of sizes as even as can be (one compiled graph per size)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, u in enumerate(us):
        _check(
            u.ndim >= 2,
            f"Muon orthogonalises matrices; got a tensor of shape {tuple(u.shape)}: give 1-D "
            "parameters to the Adam half (dsfunc.optim.muon.takes_muon)",
        )
        groups.setdefault((u.shape, u.dtype, u.device), []).append(i)
    out = []
    for (shape, _, _), group in groups.items():
        parts = min(len(group), -(-len(group) * math.prod(shape) // max_elements))
        out += [group[j * len(group) // parts : (j + 1) * len(group) // parts] for j in range(parts)]
    return out


def _orthogonalize(stack: Tensor, steps: int, method: str, dtype: torch.dtype) -> Tensor:
    """:func:`orthogonalize` of every parameter of ``stack`` (``[k, *shape]``: k parameters of one shape)."""
    x = stack.reshape(len(stack), stack.size(1), -1) if stack.ndim == 5 else stack  # conv filters as (out, -1)
    out = NS_METHODS[method](x, steps, dtype)
    rows, cols = stack.size(-2), stack.size(-1)
    if rows > cols:  # DeepSpeed's scale, in the iteration's dtype; written so that symbolic sizes compile
        out *= math.sqrt(rows / cols)
    return out.reshape(stack.shape).to(stack.dtype)


@functools.cache
def _compiled() -> Callable[[Tensor, int, str, torch.dtype], Tensor]:
    """:func:`_orthogonalize` under ``torch.compile`` with torch's defaults, as DeepSpeed compiles; made on first
    use (``torch.compile`` imports dynamo, a third of ``import dsfunc``'s time)."""
    return torch.compile(_orthogonalize)


@dataclasses.dataclass(frozen=True)
class MatrixShards:
    """Where a Muon unit's matrices lie in its flat buffer and how this rank holds it (see [Note: whole
    matrices under ZeRO]): ``gather(shard) -> flat`` returns the whole (padded) flat buffer from every rank's
    shard (``shard`` itself where one rank holds the whole unit)."""

    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    local: tuple[int, int]  # this rank's [start, stop) in the flat buffer
    gather: Callable[[Tensor], Tensor]

    def whole_matrices(self, shard: Tensor) -> tuple[Tensor, list[tuple[Tensor, slice, slice]]]:
        """Gathers the unit and returns the update's buffer (laid out like ``shard``, its padding zeroed, the
        rest to fill) and every whole matrix that overlaps this rank's shard, each with the slice of the buffer
        it fills and the slice of the flattened matrix that goes there. The matrices are views of ``shard``
        where the gather is the shard itself, else copies, so that the gathered buffer is freed: a rank keeps
        about its shard's worth, not every unit's whole buffer, until they are orthogonalised."""
        start, stop = self.local
        flat = self.gather(shard)
        out, filled, pieces = torch.empty_like(shard), start, []
        for shape, offset in zip(self.shapes, self.offsets):
            lo, hi = max(offset, start), min(offset + math.prod(shape), stop)
            if lo >= hi:
                continue  # another rank's matrix
            if lo > filled:
                out[filled - start : lo - start].zero_()  # a gap: padding
            full = flat[offset : offset + math.prod(shape)].view(shape)
            pieces.append((full if flat is shard else full.clone(), slice(lo - start, hi - start),
                           slice(lo - offset, hi - offset)))
            filled = hi
        if filled - start < len(out):  # padding after the last matrix, in the unit or after it (the last rank's)
            out[filled - start :].zero_()
        return out, pieces


def orthogonalize_shards(
    shards: Mapping[str, Tensor], matrices: Mapping[str, MatrixShards], steps: int, method: str
) -> dict[str, Tensor]:
    """This rank's slice of every matrix's :func:`orthogonalize`, laid out like each of ``shards`` (keyed as
    ``matrices``): the units are gathered one by one, in the order of ``shards`` (every rank must make the same
    calls), then their matrices go through :func:`orthogonalize_all` together, so that matrices of one shape in
    several units share a call."""
    out, pieces = {}, []
    for key, shard in shards.items():
        _check(key in matrices, f"scale_by_muon: no matrix layout for {key!r}; it has {sorted(matrices)}")
        out[key], mine = matrices[key].whole_matrices(shard)
        pieces += [(key, *piece) for piece in mine]
    for i, update in orthogonalize_all([full for _, full, _, _ in pieces], steps, method):
        key, _, into, part = pieces[i]
        out[key][into] = update.reshape(-1)[part].to(out[key].device)
    return out


class ScaleByMuonState(NamedTuple):
    """State of :func:`scale_by_muon`: the momentum (one buffer, where Adam keeps two)."""

    momentum: Updates


def scale_by_muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    matrices: Mapping[str, MatrixShards] | None = None,
    ns_method: str = "gram",
) -> Transform:
    """Muon's direction: the momentum EMA, the nesterov blend, then :func:`orthogonalize`, every matrix of one
    shape in one call (:func:`orthogonalize_all`).

    Without ``matrices`` each leaf is one whole parameter in its own shape. With them, each leaf is a flat
    shard (a ZeRO unit's, keyed by unit name) whose matrices ``matrices[key]`` describes
    (:func:`orthogonalize_shards`).
    """
    _check(0.0 <= momentum < 1.0, f"Muon's momentum must be in [0, 1), got {momentum!r}")
    _check(ns_steps >= 1, f"ns_steps must be >= 1, got {ns_steps!r}")
    _check(ns_method in NS_METHODS, f"ns_method must be one of {sorted(NS_METHODS)}, got {ns_method!r}")

    def init(params: Params) -> ScaleByMuonState:
        return ScaleByMuonState(_map(torch.zeros_like, params))

    def update(
        updates: Updates, state: ScaleByMuonState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByMuonState]:
        m = _map(lambda m, g: m.lerp(g, 1 - momentum), state.momentum, updates)
        blend = _map(lambda g, m: g.lerp(m, momentum), updates, m) if nesterov else m
        if matrices is not None:
            return orthogonalize_shards(blend, matrices, ns_steps, ns_method), ScaleByMuonState(m)
        leaves, spec = optree.tree_flatten(blend)
        out = [None] * len(leaves)
        for i, update in orthogonalize_all(leaves, ns_steps, ns_method):
            out[i] = update
        return optree.tree_unflatten(spec, out), ScaleByMuonState(m)

    return Transform(init, update)


def muon(
    lr: ScalarOrSchedule = 0.02,
    momentum: float = 0.95,
    weight_decay: float = 0.0,
    nesterov: bool = True,
    ns_steps: int = 5,
    matrices: Mapping[str, MatrixShards] | None = None,
    ns_method: str = "gram",
) -> Transform:
    """Muon for hidden weight matrices (DeepSpeed's defaults): ``p = p * (1 - lr * wd) - lr * muon_direction``.
    State keys: ``muon``, ``weight_decay``, ``lr``.

    >>> tx = muon(lr=0.1)
    >>> w = {"w": torch.ones(2, 3)}
    >>> updates, _ = tx.update({"w": torch.eye(2, 3)}, tx.init(w), w)
    >>> updates["w"].shape
    torch.Size([2, 3])
    """
    return named_chain(
        ("muon", scale_by_muon(momentum, nesterov, ns_steps, matrices, ns_method)),
        ("weight_decay", add_decayed_weights(weight_decay)),
        ("lr", scale_by_learning_rate(lr)),
    )


# DeepSpeed's engine (_MUON_HALF_KEYS, _ADAM_HALF_KEYS): the keys each half of a parameter group takes
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
DEFAULT_LR = {True: 0.02, False: 3e-4}  # MuonWithAuxAdam's, for a half that no setting gives an lr


def half_options(params: Mapping[str, Any], group: Mapping[str, Any], use_muon: bool) -> dict[str, Any]:
    """One half's options, resolved as DeepSpeed's ``_muon_param_groups`` does, most specific last: the config's
    shared value, then ``muon_lr`` / ``adam_lr``, then the parameter group's own (only that half's keys)."""
    keys, override = (MUON_KEYS, "muon_lr") if use_muon else (ADAM_KEYS, "adam_lr")
    lr = params[override] if params.get(override) is not None else params.get("lr")
    options = {"lr": DEFAULT_LR[use_muon] if lr is None else lr}
    options.update({k: v for k, v in group.items() if k in keys})
    return options


def muon_half(
    params: Mapping[str, Any],
    use_muon: bool | None,
    schedule: ScalarOrSchedule | None,
    matrices: Mapping[str, MatrixShards] | None,
) -> Transform:
    """The update of one half of a DeepSpeed Muon group: :func:`muon` for hidden matrices, else Adam
    (decoupled decay unless ``adam_w_mode`` is false). ``params`` is the half's validated ``optimizer.params``
    with its lr resolved (:func:`half_options`)."""
    if use_muon is None:
        raise InputError(
            '"type": "Muon" updates some parameters with Muon and the rest with Adam, which needs '
            "the parameters: build the state with dsfunc.init_state (or dsfunc.initialize), which "
            "splits them by DeepSpeed's rule (dsfunc.optim.muon.takes_muon)"
        )
    lr = schedule if schedule is not None else params["lr"]
    if use_muon:
        return muon(lr, params["momentum"], params["weight_decay"], matrices=matrices, ns_method=params["ns_method"])
    return adam(lr, params["betas"], params["eps"], params["weight_decay"], adam_w_mode=params["adam_w_mode"])


def muon_groups(
    shapes: Mapping[str, tuple[int, ...]], params: Mapping[str, Any], groups: ParamGroups | None = None
) -> ParamGroups:
    """DeepSpeed's split of every parameter group into a Muon half and an Adam half (by :func:`takes_muon`),
    labelled as DeepSpeed names them (``muon-params``, ``adam-params``; ``<group>-muon-params`` when there are
    groups), each with its resolved options (:func:`half_options`) and ``use_muon``. A group whose options set
    ``use_muon`` (as ``MuonWithAuxAdam``'s groups do; DeepSpeed's engine ignores it) overrides the name rule:
    False puts all its parameters on Adam (a model whose embeddings are not named ``embed``), True its matrices
    on Muon.

    Args:
      shapes: every trainable parameter's name and (whole) shape.
      params: the config's validated Muon ``optimizer.params``.
      groups: the caller's parameter groups, each split in two.
    """
    bases = groups.order(shapes) if groups is not None else [None]
    labels, options = {}, {}
    for name, shape in shapes.items():
        base = groups.label_of(name) if groups is not None else None
        chosen = groups.options.get(base, {}).get("use_muon") if groups is not None else None
        half = takes_muon(name, shape) if chosen is None else bool(chosen) and len(shape) >= 2
        word = "muon" if half else "adam"
        labels[name] = f"{word}-params" if base is None else f"{base}-{word}-params"
        options.setdefault((bases.index(base), not half), (labels[name], base, half))
    ordered = {}
    for _, (label, base, half) in sorted(options.items()):
        own = groups.options.get(base, {}) if groups is not None else {}
        ordered[label] = {**half_options(params, own, half), "use_muon": half}
    return ParamGroups(label=labels, options=ordered)
