"""The fast update path: the config's Adam/AdamW applied in place by dsfunc's fused op.

When the optimizer comes from the config and is Adam or AdamW (without OneCycle's cycled momentum),
the step does not run the transform chain. Instead, per unit, one ``dsfunc::adam_step_`` call unscales
and clips the gradient, skips on overflow, updates the moments and the fp32 master in place, and
writes the compute-dtype copy that the next all-gather sends: one pass over memory. On CUDA that is the
kernel in ``ops/``; elsewhere the op's plain-torch reference runs (the same math as the chain
``scale_by_factor -> clip_by_global_norm -> adam``, up to the unscale and clip factors being multiplied
once instead of twice). Its state is the equivalent chain's (:meth:`FusedAdam.init`), so checkpoints and
the chain read it unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dsfunc import kernels
from dsfunc.config import Config
from dsfunc.frozen import FrozenDict
from dsfunc.optim.base import Transform
from dsfunc.optim.update import UpdateContext

Schedule = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class FusedAdam:
    """The config's Adam/AdamW: its hyper-parameters, its lr schedule, and the chain whose state it keeps."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction: bool
    max_norm: float
    schedule: Schedule | None
    lr: float
    chain: Transform  # unscale -> clip -> adam: the same math, and the layout of the state
    writes_compute_copy = True  # the update writes this rank's slice of the 16-bit compute copy

    @classmethod
    def from_config(cls, cfg: Config, chain: Transform, schedule: Schedule | None) -> FusedAdam | None:
        """The fused update for ``cfg``'s optimizer, or None when it is not plain Adam/AdamW."""
        opt = cfg.optimizer
        if opt is None or opt.type not in ("adam", "adamw"):
            return None
        p = opt.params
        beta1, beta2 = p["betas"]
        return cls(
            beta1=float(beta1), beta2=float(beta2), eps=float(p["eps"]), weight_decay=float(p["weight_decay"]),
            adam_w_mode=opt.type == "adamw" or bool(p["adam_w_mode"]),
            bias_correction=bool(p["bias_correction"]), max_norm=float(cfg.gradient_clipping),
            schedule=schedule, lr=float(p["lr"]), chain=chain,
        )

    def init(self, params: Mapping[str, torch.Tensor]) -> Any:
        return self.chain.init(dict(params))

    def apply(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], opt_state: Any,
              ctx: UpdateContext) -> tuple[FrozenDict, Any]:
        """Update ``params``, the moments and ``ctx.lowp`` in place; return them with the new counters."""
        loss_scale, grad_norm, finite = ctx.loss_scale, ctx.grad_norm, ctx.finite
        chain = opt_state["optimizer"]
        adam, sched = chain["adam"], chain["lr"]
        if self.schedule is None:
            lr = torch.full((), self.lr, dtype=torch.float32, device=loss_scale.device)
        else:
            lr = self.schedule(sched.count - 1).to(torch.float32)
        clip = torch.ones_like(grad_norm)
        if self.max_norm > 0:
            clip = torch.clamp((grad_norm + 1e-6) / self.max_norm, min=1.0)
        grad_scale = (1.0 / (loss_scale * clip)).to(torch.float32)
        step = (adam.count + 1).to(torch.float32)
        skip = ~finite
        for name, param in params.items():
            kernels.adam_step_(
                param, grads[name], adam.mu[name], adam.nu[name],
                grad_scale=grad_scale, lr=lr, step=step, skip=skip, lowp=ctx.lowp.get(name),
                beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                adam_w_mode=self.adam_w_mode, bias_correction=self.bias_correction,
            )
        applied = finite.to(adam.count.dtype)
        chain = {
            **chain,
            "adam": adam._replace(count=adam.count + applied),
            "lr": sched._replace(count=sched.count + applied, lr=torch.where(finite, lr, sched.lr)),
        }
        return FrozenDict(params), {**opt_state, "optimizer": chain}
