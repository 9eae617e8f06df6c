"""``torch.ops.dsfunc.adam_steps_``: the Adam/AdamW update of a list of flat fp32 shards, in place, one pass each.

It unscales the raw gradient, applies (L2 or decoupled) weight decay, both moments, bias correction and
the learning rate, and optionally writes the bf16/fp16 copy of the new parameters that the next
all-gather sends. A 0-d bool ``skip`` (the found-inf flag) turns the whole call into a no-op on the
device. Everything that changes per step is a tensor argument, so a step neither synchronises with the
host nor recompiles.

One call takes every shard of a parameter group (the step's units share its scalars and hyper-parameters),
so the step pays the op's Python and dispatch once per group, not once per unit; on CUDA the kernels are
launched from C++. ``lowps`` is empty (no 16-bit copy) or holds one tensor per shard: torch's
functionalization cannot take a mutable list with holes. The op is defined with
``torch.library.Library.define``/``impl`` rather than ``custom_op``: a call costs ~2 us of Python instead of
~15 us. Its signature is written in the schema below, in :func:`adam_steps_`, in ``ops/register.cpp``, and
per shard in :class:`AdamArgs` and ``ops/adam_cpu.cpp`` (the host kernel of ZeRO-Offload).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from dsfunc.errors import InputError
from dsfunc.kernels.native import native_ready

_LOWP_DTYPES = (torch.bfloat16, torch.float16)
_SCHEMA = (
    "adam_steps_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] lowps, Tensor grad_scale, Tensor lr, Tensor step, Tensor skip, float beta1, "
    "float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction) -> ()"
)

_lib = torch.library.Library("dsfunc", "FRAGMENT")
_lib.define(_SCHEMA)


class AdamArgs(NamedTuple):
    """One shard's call in the per-shard order of the host kernel (``ops/adam_cpu.cpp``)."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    lowp: Tensor | None
    grad_scale: Tensor
    lr: Tensor
    step: Tensor
    skip: Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction: bool


def _shards(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
            exp_avg_sqs: Sequence[Tensor], lowps: Sequence[Tensor]) -> list[tuple[Tensor, ...]]:
    """The op's lists as one ``(param, grad, exp_avg, exp_avg_sq, lowp or None)`` per shard, checked."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n and len(lowps) in (0, n)):
        raise InputError(
            f"dsfunc.adam_steps_: params, grads, exp_avgs and exp_avg_sqs need one tensor per shard and lowps none "
            f"or one per shard, got {n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)} and {len(lowps)}"
        )
    shards = [(p, g, m, v, lowps[i] if lowps else None)
              for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs))]
    for i, shard in enumerate(shards):
        _check_shard(*shard, where="" if n == 1 else f" (shard {i})")
    return shards


def _check_shard(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, lowp: Tensor | None, *,
                 where: str = "") -> None:
    device, numel = param.device, param.numel()
    flats = [("param", param, (torch.float32,)), ("grad", grad, (torch.float32, *_LOWP_DTYPES)),
             ("exp_avg", exp_avg, (torch.float32,)), ("exp_avg_sq", exp_avg_sq, (torch.float32,))]
    if lowp is not None:
        flats.append(("lowp", lowp, _LOWP_DTYPES))
    for name, t, dtypes in flats:
        if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous():
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            layout = "" if t.is_contiguous() else ", non-contiguous"
            raise InputError(
                f"dsfunc.adam_step_: {name} must be a 1-D contiguous {want} tensor (a flat shard), "
                f"got {t.dtype} of shape {tuple(t.shape)}{layout}{where}; pass t.reshape(-1) of a contiguous tensor"
            )
        if t.device != device or t.numel() != numel:
            raise InputError(
                f"dsfunc.adam_step_: {name} must match param ({numel} elements on {device}), "
                f"got {t.numel()} elements on {t.device}{where}"
            )


def _check_scalars(device: torch.device, grad_scale: Tensor, lr: Tensor, step: Tensor, skip: Tensor,
                   beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    for name, t, dtype in (("grad_scale", grad_scale, torch.float32), ("lr", lr, torch.float32),
                           ("step", step, torch.float32), ("skip", skip, torch.bool)):
        if t.dim() != 0 or t.dtype != dtype or t.device != device:
            raise InputError(
                f"dsfunc.adam_step_: {name} must be a 0-d {dtype} tensor on {device} (per-step values stay "
                f"on the device: no host sync, no recompilation), got {t.dtype} of shape {tuple(t.shape)} "
                f"on {t.device}"
            )
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise InputError(f"dsfunc.adam_step_: betas must lie in [0, 1), got beta1={beta1}, beta2={beta2}")
    if eps < 0.0 or weight_decay < 0.0:
        raise InputError(
            f"dsfunc.adam_step_: eps and weight_decay must be >= 0, got {eps} and {weight_decay}"
        )


def _check(a: AdamArgs) -> None:
    """One shard's call, checked as the op checks it."""
    _check_shard(a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.lowp)
    _check_scalars(a.param.device, *a[5:13])


def _check_all(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor], lowps: Sequence[Tensor], *scalars: object) -> list[tuple[Tensor, ...]]:
    """The checks shared by the reference, the CUDA path and the fake implementation; the shards."""
    shards = _shards(params, grads, exp_avgs, exp_avg_sqs, lowps)
    if shards:
        device = params[0].device
        elsewhere = [i for i, p in enumerate(params) if p.device != device]
        if elsewhere:
            raise InputError(f"dsfunc.adam_steps_: every shard must be on one device, but shard {elsewhere[0]} is "
                             f"on {params[elsewhere[0]].device} and shard 0 on {device}; make one call per device")
        _check_scalars(device, *scalars[:8])
    return shards


def bias_corrections(beta1: float | Tensor, beta2: float | Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """Adam's ``1 - beta1**t`` and ``sqrt(1 - beta2**t)`` at ``t = step``, as float32 0-d tensors on the step's
    device (no host sync), accurate to float32 rounding of the result.

    Each is computed in float64 from the betas as given (a float32 0-d tensor beta is widened) and rounded
    once, as torch.optim.AdamW computes them in Python floats. In float32 ``1 - 0.999`` alone is 1.3e-5
    relative off, which made every update of the first ~1000 steps ~6e-6 too small. The CUDA kernel
    (``ops/adam.cu``, ``load_scalars``) computes the same two numbers the same way.
    """
    t = step.to(torch.float64)
    b1, b2 = (b.to(torch.float64) if isinstance(b, Tensor) else b for b in (beta1, beta2))
    return (1 - b1**t).to(torch.float32), (1 - b2**t).sqrt().to(torch.float32)


def _reference(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               lowps: list[Tensor], *scalars: object) -> None:
    """Plain torch, on every device (the CPU path). Per shard, the exact sequence of torch calls of dsfunc.optim's
    chain (scale_by_factor -> scale_by_adam -> add_decayed_weights -> scale_by_learning_rate), so that
    this op and the chain agree bit for bit."""
    shards = _check_all(params, grads, exp_avgs, exp_avg_sqs, lowps, *scalars)
    if not shards:
        return
    grad_scale, lr, step, skip, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction = scalars
    if bias_correction:
        bc1, bc2_sqrt = bias_corrections(beta1, beta2, step)
    for param, grad, exp_avg, exp_avg_sq, lowp in shards:
        g = grad.float() * grad_scale
        if weight_decay != 0.0 and not adam_w_mode:
            g = g.add(param, alpha=weight_decay)
        m = exp_avg.mul(beta1).add(g, alpha=1 - beta1)
        v = exp_avg_sq.mul(beta2).addcmul(g, g, value=1 - beta2)
        if bias_correction:
            u = (m / bc1) / (v.sqrt() / bc2_sqrt).add(eps)
        else:
            u = m / v.sqrt().add(eps)
        if weight_decay != 0.0 and adam_w_mode:
            u = u.add(param, alpha=weight_decay)
        u = u * (-lr)
        new_p = param + u
        param.copy_(torch.where(skip, param, new_p))
        exp_avg.copy_(torch.where(skip, exp_avg, m))
        exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, v))
        if lowp is not None:
            lowp.copy_(torch.where(skip, lowp, new_p.to(lowp.dtype)))


def _cuda(*args: object) -> None:
    if not native_ready():
        _reference(*args)
        return
    # checked here first: a failed check inside the extension ends the process on the device (bench/RESULTS.md)
    _check_all(*args)
    torch.ops.dsfunc_cuda.adam_steps_.default(*args)
    params, _, exp_avgs, exp_avg_sqs, lowps = args[:5]
    _written(params, exp_avgs, exp_avg_sqs, lowps)


def host_adam_step_(*args: object, sources: Sequence[Tensor] = ()) -> None:
    """One shard's update on host tensors by the CPU kernel of ``ops/adam_cpu.cpp`` (ZeRO-Offload's update), which
    holds no Python lock while it runs; the reference where that kernel cannot be built. Arguments in
    :class:`AdamArgs` order, checked as the public op checks them; ``sources``: the param and moments to read
    instead of the written ones' own values (empty: in place)."""
    a = AdamArgs(*args)
    _check(a)
    if not native_ready("cpu"):
        _read(sources, [a.param, a.exp_avg, a.exp_avg_sq])
        _reference([a.param], [a.grad], [a.exp_avg], [a.exp_avg_sq], [] if a.lowp is None else [a.lowp], *a[5:])
        return
    torch.ops.dsfunc_cpu.adam_step_.default(*a, sources=list(sources))
    _written([a.param], [a.exp_avg], [a.exp_avg_sq], [] if a.lowp is None else [a.lowp])


def host_adam_bf16_step_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                         compensation: Tensor | None, grad_scale: Tensor, clip: Tensor, lr: Tensor, step: Tensor,
                         skip: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                         adam_w_mode: bool, bias_correction: bool, sources: Sequence[Tensor] = ()) -> None:
    """One bf16 shard's Adam/AdamW step by the CPU kernel of ``ops/adam_cpu.cpp``, bit for bit what
    :mod:`dsfunc.optim.low_precision`'s chain writes (:mod:`dsfunc.optim.low_precision_host` decides when it runs,
    after ``native_ready("cpu")``). ``param``, the moments and ``compensation`` (Kahan's, or None: rounding to
    nearest) are flat bf16, ``grad`` bf16 or fp32; the gradient is multiplied by ``grad_scale``, then by ``clip``
    (the clip coefficient); ``step`` counts this step (fp32 0-d); nothing is written when ``skip``. ``sources``:
    the param, moments (and compensation) to read instead of the written ones' own values (empty: in place)."""
    torch.ops.dsfunc_cpu.adam_bf16_step_.default(
        param, grad, exp_avg, exp_avg_sq, compensation, grad_scale, clip, lr, step, skip, float(beta1),
        float(beta2), float(eps), float(weight_decay), bool(adam_w_mode), bool(bias_correction),
        sources=list(sources))
    _written([param, exp_avg, exp_avg_sq], [] if compensation is None else [compensation])


def _read(sources: Sequence[Tensor], written: Sequence[Tensor]) -> None:
    """Where no kernel runs: the reference updates in place, so the ``sources`` are copied into what it writes."""
    for out, src in zip(written, sources, strict=bool(sources)):
        out.copy_(src)


def _written(*lists: Sequence[Tensor]) -> None:
    """Bump the version of what a kernel wrote, as the in-place torch ops it stands for would: the private ops of
    ops/ register no kernel for the dispatch key that does it for torch's own (ADInplaceOrView)."""
    torch.autograd.graph.increment_version([t for ts in lists for t in ts])


def _fake(*args: object) -> None:
    _check_all(*args)


_lib.impl("adam_steps_", _reference, "CompositeExplicitAutograd")
_lib.impl("adam_steps_", _cuda, "CUDA")
torch.library.register_fake("dsfunc::adam_steps_", _fake, lib=_lib)


def adam_steps_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    grad_scale: Tensor,
    lr: Tensor,
    step: Tensor,
    skip: Tensor,
    lowps: Sequence[Tensor] = (),
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """One Adam/AdamW step on flat fp32 shards that share this step's scalars, in place
    (``torch.ops.dsfunc.adam_steps_``); each shard as :func:`adam_step_` says. ``lowps`` is empty or holds one
    16-bit tensor per shard."""
    torch.ops.dsfunc.adam_steps_.default(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(lowps), grad_scale, lr, step, skip,
        float(beta1), float(beta2), float(eps), float(weight_decay), bool(adam_w_mode), bool(bias_correction),
    )


def adam_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    grad_scale: Tensor,
    lr: Tensor,
    step: Tensor,
    skip: Tensor,
    lowp: Tensor | None = None,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """One Adam/AdamW step on a flat fp32 shard, in place (:func:`adam_steps_` of one shard).

    Args:
        param: 1-D contiguous fp32 master weights; updated in place.
        grad: gradient of the same size, still multiplied by the loss scale: fp32, or bf16/fp16 (read as it is
            and widened element by element, which is exact: no fp32 copy of it is made).
        exp_avg, exp_avg_sq: fp32 first and second moments; updated in place.
        grad_scale: 0-d fp32, the factor applied to ``grad`` first (1 / (loss_scale * clip_coef)).
        lr: 0-d fp32 learning rate of this step.
        step: 0-d fp32 count of applied steps including this one (bias correction uses it).
        skip: 0-d bool found-inf flag; when true nothing is written (every byte stays as it was).
        lowp: optional 1-D bf16/fp16 tensor of the same size that receives the new params cast down.
        beta1, beta2, eps, weight_decay: Adam hyper-parameters.
        adam_w_mode: decoupled weight decay (AdamW) if true, L2 added to the gradient if false.
        bias_correction: divide the moments by ``1 - beta**step``.

    On an H200 the CUDA update runs at 93% of the copy-bandwidth floor when all five tensors start at
    multiples of 32 elements (128 bytes) into their buffers; views that share another offset run at 79%,
    an aligned update whose lowp alone is misaligned at 80%, and a grad or moment whose offset differs
    from param's mod 4 elements falls back to a scalar kernel at 72% (bench/RESULTS.md).

    Example:
        >>> p, g = torch.ones(4), torch.full((4,), 2.0)
        >>> m, v = torch.zeros(4), torch.zeros(4)
        >>> one, t, no = torch.tensor(1.0), torch.tensor(1.0), torch.tensor(False)
        >>> adam_step_(p, g, m, v, grad_scale=one, lr=torch.tensor(0.1), step=t, skip=no)
        >>> p
        tensor([0.9000, 0.9000, 0.9000, 0.9000])
    """
    adam_steps_([param], [grad], [exp_avg], [exp_avg_sq], lowps=() if lowp is None else (lowp,),
                grad_scale=grad_scale, lr=lr, step=step, skip=skip, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, adam_w_mode=adam_w_mode, bias_correction=bias_correction)
