"""The config's Adam/AdamW on the host (ZeRO-Offload): torch's own fused, vectorised CPU kernel.

``torch._fused_adamw_`` / ``torch._fused_adam_`` update a list of flat shards in one call, multi-threaded
(intra-op threads) and vectorised: on a 4M-element shard with 2 threads, 47 ms against the 1.40 s of the
plain-torch reference of ``dsfunc::adam_step_`` (the README's ZeRO-Offload section says how it was timed).
Their math is Adam's with bias corrections in float64, as :func:`dsfunc.kernels.adam.bias_corrections`;
they round differently from the reference (AdamW's weight decay is applied to the parameter before the
step, the step size is ``lr / bc1``), so an offloaded run agrees with one that is not to float32 rounding,
not bit for bit. Their ``grad_scale`` divides the gradients (which are overwritten, unscaled) and a
``found_inf`` of 1 turns the call into a no-op.

The host gradient buffers may be 16-bit (:mod:`dsfunc.zero.offload`): each unit is then widened to fp32
just before its update (``widen``: ZeRO-Offload's scratch buffer, reused), so the widened copy costs the
bytes of the largest unit, not of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def host_adam_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], *, grad_divisor: torch.Tensor, lr: torch.Tensor,
               step: torch.Tensor, skip: torch.Tensor, beta1: float, beta2: float, eps: float,
               weight_decay: float, adam_w_mode: bool, widen: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.float,
               done: Callable[[int], None] | None = None) -> None:
    """One Adam (``adam_w_mode=False``: L2 decay) or AdamW step of host shards, in place.

    Args:
      params, grads, exp_avgs, exp_avg_sqs: flat CPU tensors, one of each per unit, fp32 but for 16-bit
        grads (fp32 grads are unscaled in place; 16-bit ones go through ``widen`` first).
      grad_divisor: 0-d fp32, what the gradients are divided by first (loss scale times clip coefficient).
      lr: 0-d fp32 learning rate. step: 0-d fp32 count of applied steps including this one.
      skip: 0-d bool; when true nothing is written.
      done: called with each unit's index once its parameter is written.
    """
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    found_inf = skip.to(torch.float32)
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        fused([param], [widen(grad)], [exp_avg], [exp_avg_sq], [], [step], lr=lr, beta1=beta1, beta2=beta2,
              weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_divisor,
              found_inf=found_inf)
        if done is not None:
            done(i)
