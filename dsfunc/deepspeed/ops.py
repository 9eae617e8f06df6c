"""``deepspeed.ops.adam`` / ``deepspeed.ops.lamb`` / ``deepspeed.ops.adagrad``: DeepSpeed's optimizer classes,
as scripts build them to pass to ``initialize(optimizer=...)``::

    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    optimizer = FusedAdam(optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

Each is a ``torch.optim.Optimizer`` holding its ``param_groups`` with DeepSpeed's argument names and
defaults; ``initialize`` maps it onto the equivalent config section (FusedAdam and DeepSpeedCPUAdam:
Adam, decoupled with ``adam_w_mode``/``adamw_mode``; FusedLamb: Lamb; DeepSpeedCPUAdagrad: Adagrad), so
dsfunc's own update trains with the same hyper-parameters per group. Stepping one directly is an error:
the engine steps. Options with no dsfunc equivalent (``amsgrad``, FusedLamb's ``eps_inside_sqrt`` and
``max_grad_norm``) are refused when set.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dsfunc.errors import InputError, UsageError, unsupported


class DeepSpeedOptimizer(torch.optim.Optimizer):
    """Base of DeepSpeed's optimizer classes here: param groups with DeepSpeed's names, stepped by the engine."""

    config_type: ClassVar[str]  # the DeepSpeed config "optimizer.type" it is
    renamed: ClassVar[dict[str, str]] = {}  # argument name -> config param name
    refused: ClassVar[dict[str, Any]] = {"amsgrad": False}  # arguments that must keep these values
    ignored: ClassVar[tuple[str, ...]] = ()  # arguments that choose an implementation only

    def __init__(self, params: Any, **defaults: Any) -> None:
        for key, allowed in self.refused.items():
            if defaults.get(key, allowed) != allowed:
                raise InputError(f"{type(self).__name__}({key}={defaults[key]!r}) has no dsfunc equivalent; "
                                 f"leave {key} at {allowed!r}" + (" and use the config's gradient_clipping"
                                                                   if key == "max_grad_norm" else ""))
        super().__init__(params, defaults)

    def config_params(self, group: dict[str, Any]) -> dict[str, Any]:
        """A param group's (or the defaults') options as the config's ``optimizer.params``."""
        out = {}
        for key, value in group.items():
            if key in self.refused or key in self.ignored or key in ("params", "initial_lr"):
                continue
            out[self.renamed.get(key, key)] = value
        if "initial_lr" in group:
            out["lr"] = group["initial_lr"]
        return out

    def step(self, closure: Any = None) -> None:
        raise UsageError(f"{type(self).__name__} is stepped by the engine: pass it to deepspeed.initialize("
                         "optimizer=...) and call engine.step()")


class FusedAdam(DeepSpeedOptimizer):
    """DeepSpeed's ``FusedAdam``: Adam, with decoupled weight decay (AdamW) when ``adam_w_mode``."""

    config_type = "Adam"
    ignored = ("set_grad_none",)

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adam_w_mode, weight_decay=weight_decay, amsgrad=amsgrad,
                         set_grad_none=set_grad_none)


class DeepSpeedCPUAdam(DeepSpeedOptimizer):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (ZeRO-Offload's Adam): the config's Adam, which runs where the state
    is (on the CPU, by dsfunc's host Adam kernel, when ``offload_optimizer`` puts it there)."""

    config_type = "Adam"
    renamed: ClassVar[dict[str, str]] = {"adamw_mode": "adam_w_mode"}
    ignored = ("fp32_optimizer_states",)

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adamw_mode,
                         fp32_optimizer_states=fp32_optimizer_states)


class FusedLamb(DeepSpeedOptimizer):
    """DeepSpeed's ``FusedLamb``."""

    config_type = "Lamb"
    refused: ClassVar[dict[str, Any]] = {"amsgrad": False, "eps_inside_sqrt": False, "max_grad_norm": 0.0}

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                         max_coeff=max_coeff, min_coeff=min_coeff, amsgrad=amsgrad)


class DeepSpeedCPUAdagrad(DeepSpeedOptimizer):
    """DeepSpeed's ``DeepSpeedCPUAdagrad``."""

    config_type = "Adagrad"
    ignored = ("fp32_optimizer_states",)

    def __init__(self, model_params: Any, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fp32_optimizer_states=fp32_optimizer_states)


FusedLion = unsupported("deepspeed.ops.lion.FusedLion", "the Lion optimizer", "use FusedAdam or a config optimizer")
DeepSpeedCPULion = unsupported("deepspeed.ops.lion.DeepSpeedCPULion", "the Lion optimizer",
                               "use FusedAdam or a config optimizer")
