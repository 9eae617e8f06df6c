"""``torch.ops.dsfunc.step_scalars``: the step's scalars from the global sum of squares of the gradients.

From the sum of squares (:func:`~dsfunc.kernels.sum_of_squares`) and the loss scale it gives whether the step
is finite, the skip flag (its negation), the global norm of the unscaled gradients, the factor that unscales
and clips them (``1 / (loss_scale * max(1, (norm + 1e-6) / max_norm))``, DeepSpeed's clipping, or
``1 / loss_scale`` when ``max_norm <= 0``) and the skip flag as int32 for the metrics. The reference is the nine
torch ops this used to be; on CUDA one single-thread kernel (``ops/step_scalars.cu``) computes the same
rounding, since on a small model each launch is a visible share of the step (bench/RESULTS.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsfunc.errors import InputError
from dsfunc.kernels.native import native_ready

_lib = torch.library.Library("dsfunc", "FRAGMENT")
_lib.define("step_scalars(Tensor sumsq, Tensor loss_scale, float max_norm, bool unscaled) -> "
            "(Tensor finite, Tensor skip, Tensor grad_norm, Tensor grad_scale, Tensor skipped)")


def _check(sumsq: Tensor, loss_scale: Tensor) -> None:
    for name, t in (("sumsq", sumsq), ("loss_scale", loss_scale)):
        if t.dtype != torch.float32 or t.dim() != 0:
            raise InputError(f"dsfunc.step_scalars: {name} must be a 0-d float32 tensor, got {t.dtype} "
                             f"of shape {tuple(t.shape)}")
    if loss_scale.device != sumsq.device:
        raise InputError(f"dsfunc.step_scalars: loss_scale is on {loss_scale.device} but sumsq on {sumsq.device}; "
                         "pass both on one device")


def _reference(sumsq: Tensor, loss_scale: Tensor, max_norm: float, unscaled: bool) -> tuple[Tensor, ...]:
    _check(sumsq, loss_scale)
    finite = sumsq < math.inf  # a sum of squares is >= 0, inf or nan: isfinite's answer in one op, not four
    skip = ~finite
    grad_norm = sumsq.sqrt() if unscaled else sumsq.sqrt() / loss_scale
    divisor = loss_scale
    if max_norm > 0:
        clip = torch.clamp((grad_norm + 1e-6) / max_norm, min=1.0)
        divisor = clip if unscaled else loss_scale * clip
    return finite, skip, grad_norm, divisor.reciprocal(), skip.to(torch.int32)


def _cuda(sumsq: Tensor, loss_scale: Tensor, max_norm: float, unscaled: bool) -> tuple[Tensor, ...]:
    if not native_ready():
        return _reference(sumsq, loss_scale, max_norm, unscaled)
    _check(sumsq, loss_scale)  # here, not in C++: a failed check there takes the process down on some builds
    return torch.ops.dsfunc_cuda.step_scalars.default(sumsq, loss_scale, max_norm, unscaled)


def _fake(sumsq: Tensor, loss_scale: Tensor, max_norm: float, unscaled: bool) -> tuple[Tensor, ...]:
    _check(sumsq, loss_scale)
    dtypes = (torch.bool, torch.bool, torch.float32, torch.float32, torch.int32)
    return tuple(torch.empty((), dtype=dtype, device=sumsq.device) for dtype in dtypes)


_lib.impl("step_scalars", _reference, "CompositeExplicitAutograd")
_lib.impl("step_scalars", _cuda, "CUDA")
torch.library.register_fake("dsfunc::step_scalars", _fake, lib=_lib)


def step_scalars(sumsq: Tensor, loss_scale: Tensor, max_norm: float, unscaled: bool) -> tuple[Tensor, ...]:
    """``(finite, skip, grad_norm, grad_scale, skipped)`` of a step whose gradients have sum of squares
    ``sumsq`` and are multiplied by ``loss_scale`` (``unscaled``: it is 1 for good, and not multiplied by).

    ``grad_scale`` multiplies the raw gradients into unscaled ones clipped to global norm ``max_norm``
    (no clipping when ``max_norm <= 0``); ``skipped`` is ``skip`` as int32. All are 0-d tensors on the device
    of ``sumsq``, made without a host sync.

    Example:
        >>> finite, skip, norm, factor, skipped = step_scalars(torch.tensor(25.0), torch.tensor(1.0), 1.0, True)
        >>> bool(finite), float(norm), round(float(factor), 6), int(skipped)
        (True, 5.0, 0.2, 0)
    """
    return torch.ops.dsfunc.step_scalars.default(sumsq, loss_scale, float(max_norm), unscaled)
