"""``torch.ops.dsfunc.adam_step_``: the Adam/AdamW update of one flat fp32 shard, in place, in one pass.

It unscales the raw gradient, applies (L2 or decoupled) weight decay, both moments, bias correction and
the learning rate, and optionally writes the bf16/fp16 copy of the new parameters that the next
all-gather sends. A 0-d bool ``skip`` (the found-inf flag) turns the whole call into a no-op on the
device. Everything that changes per step is a tensor argument, so a step neither synchronises with the
host nor recompiles.

The op is defined with ``torch.library.Library.define``/``impl`` rather than ``custom_op``: a call costs
~2 us of Python instead of ~15 us, which matters once per parameter unit per step. Its signature is
written in :class:`AdamArgs` (the implementations take it positionally), in the schema below, in the
public :func:`adam_step_`, in ``ops/register.cpp`` and in ``ops/adam_cpu.cpp`` (the host kernel of ZeRO-Offload).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dsfunc.errors import InputError
from dsfunc.kernels.native import native_ready

_LOWP_DTYPES = (torch.bfloat16, torch.float16)
_SCHEMA = (
    "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
    "Tensor(d!)? lowp, Tensor grad_scale, Tensor lr, Tensor step, Tensor skip, float beta1, "
    "float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction) -> ()"
)

_lib = torch.library.Library("dsfunc", "FRAGMENT")
_lib.define(_SCHEMA)


class AdamArgs(NamedTuple):
    """The op's arguments in schema order (every implementation receives them positionally)."""

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


def _check(a: AdamArgs) -> None:
    """The checks shared by the reference, the CUDA path and the fake implementation."""
    device, numel = a.param.device, a.param.numel()
    flats = [("param", a.param, (torch.float32,)), ("grad", a.grad, (torch.float32, *_LOWP_DTYPES))]
    flats += [("exp_avg", a.exp_avg, (torch.float32,)), ("exp_avg_sq", a.exp_avg_sq, (torch.float32,))]
    if a.lowp is not None:
        flats.append(("lowp", a.lowp, _LOWP_DTYPES))
    for name, t, dtypes in flats:
        if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous():
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            layout = "" if t.is_contiguous() else ", non-contiguous"
            raise InputError(
                f"dsfunc.adam_step_: {name} must be a 1-D contiguous {want} tensor (a flat shard), "
                f"got {t.dtype} of shape {tuple(t.shape)}{layout}; pass t.reshape(-1) of a contiguous tensor"
            )
        if t.device != device or t.numel() != numel:
            raise InputError(
                f"dsfunc.adam_step_: {name} must match param ({numel} elements on {device}), "
                f"got {t.numel()} elements on {t.device}"
            )
    for name, t, dtype in (("grad_scale", a.grad_scale, torch.float32), ("lr", a.lr, torch.float32),
                           ("step", a.step, torch.float32), ("skip", a.skip, torch.bool)):
        if t.dim() != 0 or t.dtype != dtype or t.device != device:
            raise InputError(
                f"dsfunc.adam_step_: {name} must be a 0-d {dtype} tensor on {device} (per-step values stay "
                f"on the device: no host sync, no recompilation), got {t.dtype} of shape {tuple(t.shape)} "
                f"on {t.device}"
            )
    if not (0.0 <= a.beta1 < 1.0 and 0.0 <= a.beta2 < 1.0):
        raise InputError(f"dsfunc.adam_step_: betas must lie in [0, 1), got beta1={a.beta1}, beta2={a.beta2}")
    if a.eps < 0.0 or a.weight_decay < 0.0:
        raise InputError(
            f"dsfunc.adam_step_: eps and weight_decay must be >= 0, got {a.eps} and {a.weight_decay}"
        )


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


def _reference(*args: object) -> None:
    """Plain torch, on every device (the CPU path). The exact sequence of torch calls of dsfunc.optim's
    chain (scale_by_factor -> scale_by_adam -> add_decayed_weights -> scale_by_learning_rate), so that
    this op and the chain agree bit for bit."""
    a = AdamArgs(*args)
    _check(a)
    p = a.param
    g = a.grad.float() * a.grad_scale
    if a.weight_decay != 0.0 and not a.adam_w_mode:
        g = g.add(p, alpha=a.weight_decay)
    m = a.exp_avg.mul(a.beta1).add(g, alpha=1 - a.beta1)
    v = a.exp_avg_sq.mul(a.beta2).addcmul(g, g, value=1 - a.beta2)
    if a.bias_correction:
        bc1, bc2_sqrt = bias_corrections(a.beta1, a.beta2, a.step)
        u = (m / bc1) / (v.sqrt() / bc2_sqrt).add(a.eps)
    else:
        u = m / v.sqrt().add(a.eps)
    if a.weight_decay != 0.0 and a.adam_w_mode:
        u = u.add(p, alpha=a.weight_decay)
    u = u * (-a.lr)
    new_p = p + u
    a.param.copy_(torch.where(a.skip, a.param, new_p))
    a.exp_avg.copy_(torch.where(a.skip, a.exp_avg, m))
    a.exp_avg_sq.copy_(torch.where(a.skip, a.exp_avg_sq, v))
    if a.lowp is not None:
        a.lowp.copy_(torch.where(a.skip, a.lowp, new_p.to(a.lowp.dtype)))


def _cuda(*args: object) -> None:
    if not native_ready():
        _reference(*args)
        return
    a = AdamArgs(*args)
    _check(a)
    torch.ops.dsfunc_cuda.adam_step_.default(*a)
    _written(a)


def host_adam_step_(*args: object) -> None:
    """:func:`adam_step_` on host tensors by the CPU kernel of ``ops/adam_cpu.cpp`` (ZeRO-Offload's update), which
    holds no Python lock while it runs; the reference where that kernel cannot be built. Arguments in schema
    order (:class:`AdamArgs`), checked here as the public op checks them."""
    a = AdamArgs(*args)
    _check(a)
    if not native_ready("cpu"):
        _reference(*a)
        return
    torch.ops.dsfunc_cpu.adam_step_.default(*a)
    _written(a)


def _written(a: AdamArgs) -> None:
    """Bump the version of what a kernel wrote, as the in-place torch ops it stands for would: the private ops of
    ops/ register no kernel for the dispatch key that does it for torch's own (ADInplaceOrView)."""
    for t in (a.param, a.exp_avg, a.exp_avg_sq, a.lowp):
        if t is not None:
            torch.autograd.graph.increment_version(t)


def _fake(*args: object) -> None:
    _check(AdamArgs(*args))


_lib.impl("adam_step_", _reference, "CompositeExplicitAutograd")
_lib.impl("adam_step_", _cuda, "CUDA")
torch.library.register_fake("dsfunc::adam_step_", _fake, lib=_lib)


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
    """One Adam/AdamW step on a flat fp32 shard, in place (``torch.ops.dsfunc.adam_step_``).

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
    torch.ops.dsfunc.adam_step_.default(
        param, grad, exp_avg, exp_avg_sq, lowp, grad_scale, lr, step, skip, float(beta1), float(beta2),
        float(eps), float(weight_decay), bool(adam_w_mode), bool(bias_correction),
    )
