"""Custom ops for the step's memory-bound hot paths, in the torch.library namespace ``dsfunc``.

``torch.ops.dsfunc.adam_step_``
    The Adam/AdamW update of one flat fp32 shard, in place and in one pass over memory: unscale the
    raw gradient, (L2 or decoupled) weight decay, both moments, bias correction, the learning rate,
    and optionally the bf16/fp16 copy of the new parameters that the next all-gather sends. A 0-d
    bool ``skip`` (the found-inf flag) turns the whole call into a no-op on the device.
``torch.ops.dsfunc.sum_of_squares``
    The sum of squares of every element of a list of tensors, as a 0-d fp32 tensor: the global
    gradient norm and the overflow check in one pass (inf/nan anywhere makes it non-finite).

Each op has a plain-torch implementation that is the reference and runs on every device (it is
the CPU path), a fake implementation so ``torch.compile`` traces through, and a CUDA kernel from
``ops/`` that the CUDA dispatch uses when it can be built. Everything that changes per step is a
tensor argument, so a step neither synchronises with the host nor recompiles.

The CUDA kernels are CUDA C++ built with ``torch.utils.cpp_extension.load`` on first use (cached
under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), not Triton, because:
``sum_of_squares`` covers a list of tensors of mixed dtypes and sizes in one launch — a device
table of pointers walked by a persistent grid and a deterministic last-block reduction, which is
direct in CUDA and awkward in Triton, whose pointer element types are fixed per compiled kernel;
the Adam update wants exact control of rounding (each step rounded as torch rounds it, no fused
multiply-add where torch has none) and 16-byte accesses with an unaligned fallback; and both ops
mutate their inputs at the end of the step, where Inductor has nothing to fuse them with, so
``triton_op``'s visibility to Inductor buys nothing. When no CUDA toolkit, ninja or compiler is
present, one line is logged and the reference runs instead (same results, slower).

The ops are defined with ``torch.library.Library.define``/``impl`` rather than ``custom_op``:
a call costs ~2 us of Python instead of ~15 us, which matters once per parameter unit per step.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["adam_step_", "fused_adam_available", "sum_of_squares"]

_log = logging.getLogger(__name__)

_OPS_DIR = Path(__file__).resolve().parent.parent / "ops"
_SOURCES = ("register.cpp", "adam.cu", "sum_of_squares.cu")
_LOWP_DTYPES = (torch.bfloat16, torch.float16)
_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_ADAM_SCHEMA = (
    "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
    "Tensor(d!)? lowp, Tensor grad_scale, Tensor lr, Tensor step, Tensor skip, float beta1, "
    "float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction) -> ()"
)

_lib = torch.library.Library("dsfunc", "FRAGMENT")
_lib.define(_ADAM_SCHEMA)
_lib.define("sum_of_squares(Tensor[] tensors) -> Tensor")


# ---------------------------------------------------------------------------------------------
# Argument checks (shared by the reference, the CUDA path and the fake implementation)


def _check_adam_args(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lowp: Tensor | None,
    grad_scale: Tensor,
    lr: Tensor,
    step: Tensor,
    skip: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    device, numel = param.device, param.numel()
    flats = [("param", param, (torch.float32,)), ("grad", grad, (torch.float32,))]
    flats += [("exp_avg", exp_avg, (torch.float32,)), ("exp_avg_sq", exp_avg_sq, (torch.float32,))]
    if lowp is not None:
        flats.append(("lowp", lowp, _LOWP_DTYPES))
    for name, t, dtypes in flats:
        if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous():
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            layout = "" if t.is_contiguous() else ", non-contiguous"
            raise ValueError(
                f"dsfunc.adam_step_: {name} must be a 1-D contiguous {want} tensor (a flat shard), "
                f"got {t.dtype} of shape {tuple(t.shape)}{layout}; pass t.reshape(-1) of a contiguous tensor"
            )
        if t.device != device or t.numel() != numel:
            raise ValueError(
                f"dsfunc.adam_step_: {name} must match param ({numel} elements on {device}), "
                f"got {t.numel()} elements on {t.device}"
            )
    for name, t, dtype in (
        ("grad_scale", grad_scale, torch.float32),
        ("lr", lr, torch.float32),
        ("step", step, torch.float32),
        ("skip", skip, torch.bool),
    ):
        if t.dim() != 0 or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"dsfunc.adam_step_: {name} must be a 0-d {dtype} tensor on {device} (per-step values stay "
                f"on the device: no host sync, no recompilation), got {t.dtype} of shape {tuple(t.shape)} "
                f"on {t.device}"
            )
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"dsfunc.adam_step_: betas must lie in [0, 1), got beta1={beta1}, beta2={beta2}")
    if eps < 0.0 or weight_decay < 0.0:
        raise ValueError(
            f"dsfunc.adam_step_: eps and weight_decay must be >= 0, got {eps} and {weight_decay}"
        )


def _check_sum_args(tensors: Sequence[Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.dtype not in _SUM_DTYPES:
            raise ValueError(
                f"dsfunc.sum_of_squares: tensor {i} is {t.dtype}; only float32, bfloat16 and float16 "
                f"are supported (cast it first)"
            )
        if t.device != tensors[0].device:
            raise ValueError(
                f"dsfunc.sum_of_squares: tensor {i} is on {t.device} but tensor 0 is on "
                f"{tensors[0].device}; pass tensors of one device"
            )


# ---------------------------------------------------------------------------------------------
# Reference implementations (plain torch; every device)


def _adam_reference(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lowp: Tensor | None,
    grad_scale: Tensor,
    lr: Tensor,
    step: Tensor,
    skip: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
) -> None:
    # The exact sequence of torch calls of dsfunc.optim's chain
    # (scale_by_factor -> scale_by_adam -> add_decayed_weights -> scale_by_learning_rate),
    # so that this op and the chain agree bit for bit.
    _check_adam_args(
        param, grad, exp_avg, exp_avg_sq, lowp, grad_scale, lr, step, skip, beta1, beta2, eps, weight_decay
    )
    p = param
    g = grad * grad_scale
    if weight_decay != 0.0 and not adam_w_mode:
        g = g.add(p, alpha=weight_decay)
    m = exp_avg.mul(beta1).add(g, alpha=1 - beta1)
    v = exp_avg_sq.mul(beta2).addcmul(g, g, value=1 - beta2)
    if bias_correction:
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        u = (m / bc1) / (v.sqrt() / bc2.sqrt()).add(eps)
    else:
        u = m / v.sqrt().add(eps)
    if weight_decay != 0.0 and adam_w_mode:
        u = u.add(p, alpha=weight_decay)
    u = u * (-lr)
    new_p = p + u
    param.copy_(torch.where(skip, param, new_p))
    exp_avg.copy_(torch.where(skip, exp_avg, m))
    exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, v))
    if lowp is not None:
        lowp.copy_(torch.where(skip, lowp, new_p.to(lowp.dtype)))


def _sum_of_squares_reference(tensors: list[Tensor]) -> Tensor:
    _check_sum_args(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([t.float().square().sum() for t in tensors]).sum()


# ---------------------------------------------------------------------------------------------
# CUDA kernels from ops/, built on first use


_native_lock = threading.Lock()
_native_ok: bool | None = None


def _native_unavailable_reason() -> str | None:
    if torch.version.cuda is None:
        return "this torch build has no CUDA support" + (
            " (ROCm is not supported)" if torch.version.hip else ""
        )
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    missing = [s for s in _SOURCES if not (_OPS_DIR / s).is_file()]
    if missing:
        return f"kernel sources {missing} not found in {_OPS_DIR}"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return f"no CUDA toolkit found (install nvcc for CUDA {torch.version.cuda} or set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _build_native() -> None:
    from torch.utils import cpp_extension

    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    gencode = [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}" for major, minor in archs]
    with warnings.catch_warnings():
        # cpp_extension's remarks about compiler versions are environment notes, not errors of ours.
        warnings.simplefilter("ignore")
        cpp_extension.load(
            name="dsfunc_ops",
            sources=[str(_OPS_DIR / s) for s in _SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", *gencode],
            is_python_module=False,
            verbose=False,
        )


def _native_ready() -> bool:
    """Build and load ops/ once per process; on failure log one line and return False."""
    global _native_ok
    if _native_ok is None:
        with _native_lock:
            if _native_ok is None:
                reason = _native_unavailable_reason()
                if reason is None:
                    try:
                        _build_native()
                    except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
                        _log.debug("dsfunc: building ops/ failed:\n%s", exc)
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                        reason = f"building {_OPS_DIR} failed: {first}"
                if reason is not None:
                    _log.warning(
                        "dsfunc: CUDA kernels unavailable (%s); using the plain-torch reference ops (slower).",
                        reason,
                    )
                _native_ok = reason is None
    return _native_ok


def _adam_cuda(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lowp: Tensor | None,
    grad_scale: Tensor,
    lr: Tensor,
    step: Tensor,
    skip: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
) -> None:
    args = (
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        lowp,
        grad_scale,
        lr,
        step,
        skip,
        beta1,
        beta2,
        eps,
        weight_decay,
    )
    if not _native_ready():
        _adam_reference(*args, adam_w_mode, bias_correction)
        return
    _check_adam_args(*args)
    torch.ops.dsfunc_cuda.adam_step_.default(*args, adam_w_mode, bias_correction)
    for t in (param, exp_avg, exp_avg_sq, lowp):
        if t is not None:
            torch.autograd.graph.increment_version(t)


def _sum_of_squares_cuda(tensors: list[Tensor]) -> Tensor:
    if not _native_ready():
        return _sum_of_squares_reference(tensors)
    _check_sum_args(tensors)
    return torch.ops.dsfunc_cuda.sum_of_squares.default([t.contiguous() for t in tensors])


def _adam_fake(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lowp: Tensor | None,
    grad_scale: Tensor,
    lr: Tensor,
    step: Tensor,
    skip: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
) -> None:
    _check_adam_args(
        param, grad, exp_avg, exp_avg_sq, lowp, grad_scale, lr, step, skip, beta1, beta2, eps, weight_decay
    )


def _sum_of_squares_fake(tensors: list[Tensor]) -> Tensor:
    _check_sum_args(tensors)
    return torch.empty((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")


_lib.impl("adam_step_", _adam_reference, "CompositeExplicitAutograd")
_lib.impl("adam_step_", _adam_cuda, "CUDA")
_lib.impl("sum_of_squares", _sum_of_squares_reference, "CompositeExplicitAutograd")
_lib.impl("sum_of_squares", _sum_of_squares_cuda, "CUDA")
torch.library.register_fake("dsfunc::adam_step_", _adam_fake, lib=_lib)
torch.library.register_fake("dsfunc::sum_of_squares", _sum_of_squares_fake, lib=_lib)


# ---------------------------------------------------------------------------------------------
# The API the step calls


def fused_adam_available(device: torch.device | str | int) -> bool:
    """Whether ``adam_step_``/``sum_of_squares`` on ``device`` run the CUDA kernels of ``ops/``.

    Builds the kernels on the first call for a CUDA device (cached across runs); on failure logs
    one line saying why. False for every other device, where the reference implementation runs.
    """
    return torch.device(device).type == "cuda" and _native_ready()


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
        grad: fp32 gradient of the same size, still multiplied by the loss scale.
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
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        lowp,
        grad_scale,
        lr,
        step,
        skip,
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adam_w_mode),
        bool(bias_correction),
    )


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
