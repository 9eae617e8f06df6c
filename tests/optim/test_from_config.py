"""The one config -> update path: named optimizers and errors from the config's table."""

from __future__ import annotations

import optree
import pytest
import torch

from dsfunc.config import ConfigError
from dsfunc.optim import (
    adagrad,
    adam,
    adamw,
    current_lr,
    lamb,
    optimizer_from_config,
    sgd,
)
from dsfunc.schedules import warmup_lr
from tests.optim.helpers import make_grads, make_params, run_ours, warmup_lr_formula

# ------------------------------------------------------------------------------------------------- from config

def test_optimizer_from_config_builds_the_named_optimizers():
    params, grads = make_params(), make_grads()[:5]
    cases = [
        ("adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False, "torch_adam": True},
         adam(lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
        ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, adamw(lr=1e-2, weight_decay=0.1)),
        ("adamw", {"lr": 1e-2, "weight_decay": 0.1}, adamw(lr=1e-2, weight_decay=0.1)),
        ("lamb", {"lr": 1e-2, "max_coeff": 0.5, "min_coeff": 0.1}, lamb(lr=1e-2, max_coeff=0.5, min_coeff=0.1)),
        ("sgd", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, sgd(lr=1e-2, momentum=0.9, nesterov=True)),
        ("adagrad", {"lr": 1e-2, "lr_decay": 0.1}, adagrad(lr=1e-2, lr_decay=0.1)),
    ]
    for kind, cfg, direct in cases:
        got, _ = run_ours(optimizer_from_config(kind, cfg, None), params, grads)
        want, _ = run_ours(direct, params, grads)
        assert optree.tree_all(optree.tree_map(torch.equal, got, want)), kind
    sched = warmup_lr(0.0, 0.1, 10)
    _, state = run_ours(optimizer_from_config("sgd", {"lr": 5.0}, sched), params, grads)
    assert current_lr(state).item() == pytest.approx(warmup_lr_formula(3, 0.0, 0.1, 10), rel=1e-6)


def test_optimizer_from_config_errors_name_the_problem():
    # a raw section is validated by the config's one table of DeepSpeed keys
    with pytest.raises(ConfigError, match=r'adam_w_mode = false contradicts optimizer.type "AdamW"'):
        optimizer_from_config("adamw", {"adam_w_mode": False}, None)
    with pytest.raises(ConfigError, match=r'optimizer.type = "rmsprop": .*not supported.*Adagrad'):
        optimizer_from_config("rmsprop", {}, None)
    with pytest.raises(ConfigError, match=r'"optimizer.params.momentum".*lr, betas'):
        optimizer_from_config("adam", {"momentum": 0.9}, None)
    with pytest.raises(ConfigError, match=r"optimizer.params.betas = \[0.9, 1.0\] is invalid: .*< 1"):
        optimizer_from_config("adam", {"betas": [0.9, 1.0]}, None)
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\)"):
        adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="nesterov momentum requires momentum > 0"):
        sgd(nesterov=True)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        adamw(weight_decay=-1.0)

