"""The config's Adam/AdamW on the host (ZeRO-Offload): dsfunc's CPU kernel, one call per unit.

``torch.ops.dsfunc_cpu.adam_step_`` (``ops/adam_cpu.cpp``) is ``dsfunc::adam_steps_`` for host memory: one pass
over each unit, spread over the intra-op threads, reading its 16-bit gradient as it is (widened exactly as
it is read: bf16 in registers, fp16 a block at a time) and writing the 16-bit copy the device gets with the
new parameters: 28 bytes of host traffic per parameter. Torch's own fused CPU Adam (``torch._fused_adamw_``) needs the gradient widened into a
buffer first and the copy cast afterwards; even done chunk by chunk while in cache it took 47-63 ms per
128M-parameter unit on 15 cores of the H200 machine, this kernel 35 ms (bench/bench_host_adam.py). Its element
arithmetic is the CUDA kernel's (``ops/adam_math.h``), so an offloaded run updates like one whose optimizer
stays on the GPU. The call holds no Python lock: the update runs in a worker thread beside the training loop
(:mod:`dsfunc.zero.offload.executor`).

Without a compiler (or ninja) the op's plain-torch reference runs instead, far slower; one line is logged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dsfunc.kernels.adam import host_adam_step_


def host_adam_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], *, grad_scale: torch.Tensor, lr: torch.Tensor,
               step: torch.Tensor, skip: torch.Tensor, beta1: float, beta2: float, eps: float,
               weight_decay: float, adam_w_mode: bool, bias_correction: bool = True,
               lowp: Sequence[torch.Tensor | None] | None = None, done: Callable[[int], None] | None = None) -> None:
    """One Adam (``adam_w_mode=False``: L2 decay) or AdamW step of host shards, in place.

    Args:
      params, grads, exp_avgs, exp_avg_sqs: flat CPU tensors, one of each per unit, fp32 but for the grads
        (fp32, bf16 or fp16, multiplied by ``grad_scale`` first).
      grad_scale: 0-d fp32, 1 / (loss scale times clip coefficient). lr: 0-d fp32 learning rate.
      step: 0-d fp32 count of applied steps including this one. skip: 0-d bool; when true nothing is written.
      lowp: per unit, a flat 16-bit tensor to receive the new parameters (or None), written with them.
      done: called with each unit's index once its parameter (and ``lowp``) is written.
    """
    hyper = (float(beta1), float(beta2), float(eps), float(weight_decay), bool(adam_w_mode), bool(bias_correction))
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        out = None if lowp is None else lowp[i]
        host_adam_step_(param, grad, exp_avg, exp_avg_sq, out, grad_scale, lr, step, skip, *hyper)
        if done is not None:
            done(i)
