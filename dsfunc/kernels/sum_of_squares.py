"""``torch.ops.dsfunc.sum_of_squares``: the sum of squares of every element of a list of tensors, as a
0-d fp32 tensor: the global gradient norm and the overflow check in one pass (inf/nan anywhere makes it
non-finite).

On CUDA one launch covers a list of tensors of mixed dtypes and sizes: a device table of pointers walked
by a persistent grid and a deterministic last-block reduction (``ops/sum_of_squares.cu``), which is
direct in CUDA and awkward in Triton, whose pointer element types are fixed per compiled kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dsfunc.errors import InputError
from dsfunc.kernels.native import native_ready

_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lib = torch.library.Library("dsfunc", "FRAGMENT")
_lib.define("sum_of_squares(Tensor[] tensors) -> Tensor")


def _check_sum_args(tensors: Sequence[Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.dtype not in _SUM_DTYPES:
            raise InputError(
                f"dsfunc.sum_of_squares: tensor {i} is {t.dtype}; only float32, bfloat16 and float16 "
                f"are supported (cast it first)"
            )
        if t.device != tensors[0].device:
            raise InputError(
                f"dsfunc.sum_of_squares: tensor {i} is on {t.device} but tensor 0 is on "
                f"{tensors[0].device}; pass tensors of one device"
            )


def _sum_of_squares_reference(tensors: list[Tensor]) -> Tensor:
    _check_sum_args(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([t.float().square().sum() for t in tensors]).sum()


def _sum_of_squares_cuda(tensors: list[Tensor]) -> Tensor:
    if not native_ready():
        return _sum_of_squares_reference(tensors)
    _check_sum_args(tensors)
    return torch.ops.dsfunc_cuda.sum_of_squares.default([t.contiguous() for t in tensors])


def _sum_of_squares_fake(tensors: list[Tensor]) -> Tensor:
    _check_sum_args(tensors)
    return torch.empty((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")


_lib.impl("sum_of_squares", _sum_of_squares_reference, "CompositeExplicitAutograd")
_lib.impl("sum_of_squares", _sum_of_squares_cuda, "CUDA")
torch.library.register_fake("dsfunc::sum_of_squares", _sum_of_squares_fake, lib=_lib)


def sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    """Sum of squares of all elements of ``tensors`` as a 0-d fp32 tensor, in one pass.

    Tensors may be fp32, bf16 or fp16, of any sizes, on one device; any inf or nan makes the
    result non-finite, so ``torch.isfinite(sum_of_squares(grads))`` is the overflow check and its
    square root the global gradient norm. An empty list gives 0.

    Example:
        >>> sum_of_squares([torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.bfloat16)])
        tensor(25.)
    """
    return torch.ops.dsfunc.sum_of_squares.default(list(tensors))
