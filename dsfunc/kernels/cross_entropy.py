"""``torch.ops.dsfunc.linear_cross_entropy``: the output projection and the mean cross-entropy in one op that
never holds the fp32 logits, and of the compute-dtype logits one chunk of rows at a time.

The rows (tokens) go through in chunks: each chunk's logits ``hidden_c @ weight.T`` are made in the compute
dtype, their loss and gradient ``(softmax - one_hot) / valid`` are computed in fp32 registers and written over
them (``dsfunc_cuda::cross_entropy_rows_`` on CUDA, ``ops/cross_entropy.cu``; plain torch elsewhere), and the
two gradient matmuls run at once. The forward thus also makes the gradients of ``hidden`` and ``weight`` (the
loss is a scalar, so backward is one multiply by its cotangent): the projection's three matmuls run once each,
as in plain autograd, and the peak holds one chunk of logits instead of the fp32 logits, their log-softmax and
their gradient (3 x 4 bytes per logit). ``with_grad=False`` (no autograd) skips the gradient work.

The op is registered with a reference implementation (every device; the CPU path), a fake implementation
(``torch.compile`` traces through it) and an autograd formula; :func:`linear_cross_entropy` is the public call
(autocast-aware, picks the chunk size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dsfunc.errors import InputError
from dsfunc.kernels.native import native_ready

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

CHUNK_BYTES = 512 * 2**20  # logits of one chunk, in the compute dtype

_lib = torch.library.Library("dsfunc", "FRAGMENT")
_lib.define("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, int ignore_index, int chunk_rows, "
            "bool with_grad) -> (Tensor, Tensor, Tensor)")


def _check(hidden: Tensor, weight: Tensor, target: Tensor, chunk_rows: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise InputError(f"dsfunc.linear_cross_entropy: hidden must be (tokens, d) and weight (vocab, d); got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise InputError(f"dsfunc.linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must "
                         "share one floating dtype (cast them, or run under torch.autocast)")
    if target.shape != (hidden.shape[0],) or target.dtype not in (torch.int64, torch.int32):
        raise InputError(f"dsfunc.linear_cross_entropy: target must be an integer vector of one class per row of "
                         f"hidden ({hidden.shape[0]}); got {target.dtype} of shape {tuple(target.shape)}")
    if chunk_rows < 1:
        raise InputError(f"dsfunc.linear_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")


def _rows_reference(logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, write_grad: bool) -> Tensor:
    """Per-row loss of a chunk of logits; with ``write_grad`` its gradient (times ``scale``) over them."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=1)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    loss = torch.where(valid, lse - lf.gather(1, safe[:, None]).squeeze(1), 0.0)
    if write_grad:
        grad = torch.exp(lf - lse[:, None])
        grad.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))
        logits.copy_(grad * (scale * valid)[:, None])
    return loss


def _rows(logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, write_grad: bool) -> Tensor:
    if logits.is_cuda and native_ready():
        return torch.ops.dsfunc_cuda.cross_entropy_rows_.default(logits, target, scale, ignore_index, write_grad)
    return _rows_reference(logits, target, scale, ignore_index, write_grad)


def _chunks(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk_rows: int, with_grad: bool,
            rows: Callable[[Tensor, Tensor, Tensor, bool], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The loop over chunks of rows: ``rows(logits, target, scale, write_grad)`` gives a chunk's summed loss and
    writes the logits' gradient (times ``scale``) over them; the gradient matmuls follow."""
    target = target.long()
    with torch.autocast(hidden.device.type, enabled=False):  # the caller chose the dtype
        scale = 1.0 / (target != ignore_index).sum().float()  # NaN loss when every row is ignored, as torch's
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if with_grad else hidden.new_empty(0)
        grad_w = torch.zeros_like(weight) if with_grad else weight.new_empty(0)
        for start in range(0, hidden.shape[0], chunk_rows):
            h, t = hidden[start : start + chunk_rows], target[start : start + chunk_rows]
            logits = h @ weight.t()
            total += rows(logits, t, scale, with_grad).sum()
            if with_grad:
                torch.mm(logits, weight, out=grad_h[start : start + chunk_rows])
                grad_w.addmm_(logits.t(), h)
        return total * scale, grad_h, grad_w


def _linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk_rows: int,
                          with_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    _check(hidden, weight, target, chunk_rows)
    return _chunks(hidden, weight, target, ignore_index, chunk_rows, with_grad,
                   lambda logits, t, scale, write: _rows(logits, t, scale, ignore_index, write))


def _linear_cross_entropy_fake(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
                               chunk_rows: int, with_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    _check(hidden, weight, target, chunk_rows)
    loss = hidden.new_empty((), dtype=torch.float32)
    if with_grad:
        return loss, torch.empty_like(hidden), torch.empty_like(weight)
    return loss, hidden.new_empty(0), weight.new_empty(0)


def _setup_context(ctx, inputs, output) -> None:
    _, grad_h, grad_w = output
    ctx.save_for_backward(grad_h, grad_w)
    ctx.with_grad = inputs[5]


def _backward(ctx, grad_loss: Tensor, _grad_h: Tensor | None, _grad_w: Tensor | None):
    if not ctx.with_grad:
        raise RuntimeError("dsfunc.linear_cross_entropy was called with with_grad=False; call it with "
                           "with_grad=True (linear_cross_entropy() does when autograd records)")
    grad_h, grad_w = ctx.saved_tensors
    return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None


_lib.impl("linear_cross_entropy", _linear_cross_entropy, "CompositeExplicitAutograd")
torch.library.register_fake("dsfunc::linear_cross_entropy", _linear_cross_entropy_fake, lib=_lib)
torch.library.register_autograd("dsfunc::linear_cross_entropy", _backward, setup_context=_setup_context, lib=_lib)


class _VocabSplit(torch.autograd.Function):
    """The op's loss and gradients for a head whose rows (the vocabulary) are split over the 1-D ``mesh``: each
    chunk's local logits go through :func:`dsfunc.parallel.vocab.sum_and_grad` (the softmax over the whole
    vocabulary, never gathered), and ``hidden``'s gradient, one part per rank's vocabulary, is summed over tp."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, chunk_rows, mesh):  # type: ignore[no-untyped-def]
        from dsfunc.distributed import comm
        from dsfunc.parallel.vocab import sum_and_grad

        def rows(logits: Tensor, t: Tensor, scale: Tensor, write: bool) -> Tensor:
            total, grad = sum_and_grad(logits, t, mesh, ignore_index)
            logits.copy_(grad * scale)
            return total

        _check(hidden, weight, target, chunk_rows)
        loss, grad_h, grad_w = _chunks(hidden, weight, target, ignore_index, chunk_rows, True, rows)
        comm.all_reduce_sum(grad_h, comm.Group.of(mesh.get_group()))
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[no-untyped-def]
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None


def default_chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """The most rows (a power of two) whose logits fit in :data:`CHUNK_BYTES`."""
    rows = max(1, CHUNK_BYTES // max(1, vocab * dtype.itemsize))
    return 1 << (rows.bit_length() - 1)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *, ignore_index: int = -100,
                         chunk_rows: int | None = None, tp_mesh: DeviceMesh | None = None) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, target, ignore_index=...)`` (the mean over the rows whose target
    is not ``ignore_index``) without the logits in memory: at most ``chunk_rows`` rows of them at a time, in
    the compute dtype, and no fp32 copy. With ``tp_mesh`` (a 1-D tp mesh), ``weight`` is this rank's rows of a
    head split by rows over it (the vocabulary): the loss is the whole vocabulary's, and no rank holds more than
    its part of any row's logits.

    ``hidden`` is ``(..., d)``, ``weight`` ``(vocab, d)`` (a tied embedding works: its gradient adds up),
    ``target`` holds one class per row of ``hidden``. Under ``torch.autocast`` both are cast to its dtype, as
    ``F.linear`` would be; otherwise they must share a dtype. The loss is fp32; the softmax and the loss are
    computed in fp32 from the logits rounded to the compute dtype (as ``F.cross_entropy(logits.float())``).

    Example:
        >>> h, w, t = torch.randn(6, 4), torch.randn(10, 4), torch.tensor([1, 2, 3, -100, 5, 9])
        >>> torch.allclose(linear_cross_entropy(h, w, t), torch.nn.functional.cross_entropy(h @ w.T, t))
        True
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = target.reshape(-1)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    rows = chunk_rows or default_chunk_rows(weight.shape[0], weight.dtype)
    if tp_mesh is not None:
        return _VocabSplit.apply(hidden, weight, target, ignore_index, rows, tp_mesh)
    loss, _, _ = torch.ops.dsfunc.linear_cross_entropy.default(hidden, weight, target, ignore_index, rows, with_grad)
    return loss
