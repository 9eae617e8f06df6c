"""The config's Adam/AdamW on the host (ZeRO-Offload): torch's own fused, vectorised CPU kernel.

``torch._fused_adamw_`` / ``torch._fused_adam_`` update a list of flat shards in one call, multi-threaded
(intra-op threads) and vectorised: on a 4M-element shard with 2 threads, 47 ms against the 1.40 s of the
plain-torch reference of ``dsfunc::adam_step_`` (the README's ZeRO-Offload section says how it was timed).
Their math is Adam's with bias corrections in float64, as :func:`dsfunc.kernels.adam.bias_corrections`;
they round differently from the reference (AdamW's weight decay is applied to the parameter before the
step, the step size is ``lr / bc1``), so an offloaded run agrees with one that is not to float32 rounding,
not bit for bit. Their ``grad_scale`` divides the gradients (which are overwritten, unscaled) and a
``found_inf`` of 1 turns the call into a no-op.

The update walks each unit in chunks of :data:`CHUNK` elements and does all of a chunk's work while it is in
the cache: a 16-bit gradient widened to fp32 (``widen``: ZeRO-Offload's scratch buffer, reused, one chunk
long), the Adam step, and the cast of the new parameters into ``lowp`` (the 16-bit copy the device gets).
Done unit-wide, each of those three is another pass through host memory: 40 bytes per parameter instead
of 28; on 15 cores of the H200 machine 53 ms instead of 42 ms per 128M-parameter unit
(bench/bench_host_adam.py). Chunks are large because the update runs in a worker thread beside the
training loop (:mod:`dsfunc.zero.host_update`) and takes the GIL back after every call: at 4M elements the
update of a 4.1B model took 1.40 s a step there, at 1M 1.78 s. With a power-of-two thread count each
thread's share of a chunk is whole vectors and the numbers are those of one call per unit, bit for bit;
with other counts the kernel's scalar tails fall elsewhere and the last bit may differ, as between thread
counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

CHUNK = 1 << 22  # elements: a multiple of every vector width, small enough for the caches, large enough per call


def host_adam_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], *, grad_divisor: torch.Tensor, lr: torch.Tensor,
               step: torch.Tensor, skip: torch.Tensor, beta1: float, beta2: float, eps: float,
               weight_decay: float, adam_w_mode: bool, widen: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.float,
               lowp: Sequence[torch.Tensor | None] | None = None, done: Callable[[int], None] | None = None,
               chunk: int = CHUNK) -> None:
    """One Adam (``adam_w_mode=False``: L2 decay) or AdamW step of host shards, in place.

    Args:
      params, grads, exp_avgs, exp_avg_sqs: flat CPU tensors, one of each per unit, fp32 but for 16-bit
        grads (fp32 grads are unscaled in place; 16-bit ones go through ``widen`` first).
      grad_divisor: 0-d fp32, what the gradients are divided by first (loss scale times clip coefficient).
      lr: 0-d fp32 learning rate. step: 0-d fp32 count of applied steps including this one.
      skip: 0-d bool; when true nothing is written.
      lowp: per unit, a flat 16-bit tensor to receive the new parameters (or None), written with them.
      done: called with each unit's index once its parameter (and ``lowp``) is written.
    """
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    found_inf = skip.to(torch.float32)
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        out = None if lowp is None else lowp[i]
        for start in range(0, param.numel(), chunk):
            part = slice(start, start + chunk)
            fused([param[part]], [widen(grad[part])], [exp_avg[part]], [exp_avg_sq[part]], [], [step], lr=lr,
                  beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
                  grad_scale=grad_divisor, found_inf=found_inf)
            if out is not None:
                out[part].copy_(param[part])
        if done is not None:
            done(i)
