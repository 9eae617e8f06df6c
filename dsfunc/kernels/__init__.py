"""Custom ops for the step's memory-bound hot paths, in the torch.library namespace ``dsfunc``.

``torch.ops.dsfunc.adam_steps_``
    The Adam/AdamW update of a list of flat fp32 shards, in place and in one pass over memory: unscale the
    raw gradient, (L2 or decoupled) weight decay, both moments, bias correction, the learning rate,
    and optionally the bf16/fp16 copy of the new parameters that the next all-gather sends. A 0-d
    bool ``skip`` (the found-inf flag) turns the whole call into a no-op on the device.
``torch.ops.dsfunc.sum_of_squares``
    The sum of squares of every element of a list of tensors, as a 0-d fp32 tensor: the global
    gradient norm and the overflow check in one pass (inf/nan anywhere makes it non-finite).
``torch.ops.dsfunc.linear_cross_entropy``
    The output projection and the mean cross-entropy in one op, a chunk of rows at a time, that never holds
    the fp32 logits; its forward also makes the gradients (:func:`linear_cross_entropy` is the public call).
``torch.ops.dsfunc.step_scalars``
    The step's scalars from the global sum of squares in one launch: finite and skip flags, the global norm,
    the factor that unscales and clips the gradients.

Each op has a plain-torch implementation that is the reference and runs on every device (it is
the CPU path), a fake implementation so ``torch.compile`` traces through, and a CUDA kernel from
``ops/`` that the CUDA dispatch uses when it can be built. Everything that changes per step is a
tensor argument, so a step neither synchronises with the host nor recompiles.

The CUDA kernels (``ops/``) are CUDA C++ rather than Triton: ``sum_of_squares`` covers a list of tensors
of mixed dtypes in one launch, and the Adam update wants exact control of rounding (each step rounded as
torch rounds it, no fused multiply-add where torch has none) and 16-byte accesses with an unaligned
fallback; both ops mutate their inputs at the end of the step, where Inductor has nothing to fuse them
with. The Adam update has a CPU kernel too (``ops/adam_cpu.cpp``, the same element arithmetic), for
ZeRO-Offload's host update (:mod:`dsfunc.optim.host_adam`); the op's CPU dispatch stays the reference, which
equals the transform chain bit for bit. See :mod:`dsfunc.kernels.native` for how they are built.
"""

from __future__ import annotations

import torch

from dsfunc.kernels.adam import adam_step_, adam_steps_
from dsfunc.kernels.cross_entropy import linear_cross_entropy
from dsfunc.kernels.native import native_ready
from dsfunc.kernels.step_scalars import step_scalars
from dsfunc.kernels.sum_of_squares import sum_of_squares

__all__ = ["adam_step_", "adam_steps_", "fused_adam_available", "linear_cross_entropy", "step_scalars",
           "sum_of_squares"]


def fused_adam_available(device: torch.device | str | int) -> bool:
    """Whether ``adam_steps_``/``sum_of_squares`` on ``device`` run the CUDA kernels of ``ops/``.

    Builds the kernels on the first call for a CUDA device (cached across runs); on failure logs
    one line saying why. False for every other device, where the reference implementation runs.
    """
    return torch.device(device).type == "cuda" and native_ready()
