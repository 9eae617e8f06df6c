"""The optimizer section: types, DeepSpeed's defaults for their params, cross-param rules."""

from __future__ import annotations

import inspect

import pytest
import torch

from dsfunc.config import FrozenDict, OptimizerConfig
from tests.config.helpers import ADAM_DEFAULTS, error, load


@pytest.mark.parametrize(
    "spelling, kind, params, expected",
    [
        ("Adam", "adam", {}, ADAM_DEFAULTS),
        ("adam", "adam", {}, ADAM_DEFAULTS),
        ("AdamW", "adamw", {}, ADAM_DEFAULTS),
        ("ADAMW", "adamw", {}, ADAM_DEFAULTS),
        (
            "SGD",
            "sgd",
            {"lr": 0.1},
            {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
        ),
        (
            "sgd",
            "sgd",
            {"lr": 0.1},
            {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
        ),
        (
            "Lamb",
            "lamb",
            {},
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "bias_correction": True,
                "max_coeff": 10.0,
                "min_coeff": 0.01,
            },
        ),
        (
            "Adagrad",
            "adagrad",
            {},
            {
                "lr": 1e-2,
                "lr_decay": 0.0,
                "weight_decay": 0.0,
                "initial_accumulator_value": 0.0,
                "eps": 1e-10,
            },
        ),
    ],
)
def test_optimizer_defaults_and_spellings(spelling, kind, params, expected):
    opt = load({"optimizer": {"type": spelling, "params": params}}).optimizer
    assert opt == OptimizerConfig(kind, expected)
    assert opt.params == expected and isinstance(opt.params, FrozenDict)


def test_optimizer_params_optional_and_values_normalised():
    assert load({"optimizer": {"type": "Adam"}}).optimizer.params == ADAM_DEFAULTS
    opt = load(
        {"optimizer": {"type": "Adam", "params": {"lr": 1, "betas": [0.8, 0.99], "torch_adam": True}}}
    ).optimizer
    assert opt.params["lr"] == 1.0 and isinstance(opt.params["lr"], float)
    assert opt.params["betas"] == (0.8, 0.99)
    assert opt.params["torch_adam"] is True


def test_torch_adam_beside_type_is_accepted_without_effect_as_deepspeed_reads_it_from_params():
    assert load({"optimizer": {"type": "Adam", "torch_adam": True}}).optimizer.params == ADAM_DEFAULTS
    assert "expected true or false" in error({"optimizer": {"type": "Adam", "torch_adam": "yes"}})


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_torch_adam_takes_torch_adamw_s_own_weight_decay_when_none_is_given(kind):
    """DeepSpeed passes the params to torch.optim.AdamW under torch_adam, so torch's default decay applies there
    (its fused Adams default to 0); an explicit value, or Adam with adam_w_mode false (torch.optim.Adam), keeps
    its own."""
    torch_default = inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
    assert torch_default > 0
    params = {"torch_adam": True}
    assert load({"optimizer": {"type": kind, "params": params}}).optimizer.params["weight_decay"] == torch_default
    assert load({"optimizer": {"type": kind, "params": {}}}).optimizer.params["weight_decay"] == 0.0
    explicit = {"torch_adam": True, "weight_decay": 0.0}
    assert load({"optimizer": {"type": kind, "params": explicit}}).optimizer.params["weight_decay"] == 0.0
    l2 = {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}}
    assert load(l2).optimizer.params["weight_decay"] == 0.0


def test_adam_w_mode():
    # DeepSpeed's "Adam" is decoupled AdamW unless adam_w_mode is false.
    assert load({"optimizer": {"type": "Adam"}}).optimizer.params["adam_w_mode"] is True
    plain = load({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer
    assert (plain.type, plain.params["adam_w_mode"]) == ("adam", False)
    msg = error({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert 'optimizer.params.adam_w_mode = false contradicts optimizer.type "AdamW"' in msg
    assert '"type": "Adam" with "adam_w_mode": false' in msg


def test_params_for_another_optimizer_are_unknown():
    msg = error({"train_batch_size": 8, "optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})
    assert 'Unknown config key "optimizer.params.betas"' in msg


def test_max_grad_norm_points_to_gradient_clipping():
    msg = error({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert msg.startswith(
        "optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer "
        "parameter, please switch to using the deepspeed parameter 'gradient_clipping'"
    )


@pytest.mark.parametrize(
    "optimizer, expected",
    [
        ({"type": "SGD"}, 'optimizer.params.lr is required for optimizer type "SGD".'),
        (
            {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}},
            (
                "optimizer.params.nesterov = true requires momentum > 0 and dampening = 0 "
                "(as torch.optim.SGD), got momentum = 0 and dampening = 0."
            ),
        ),
        (
            {"type": "SGD", "params": {"lr": 0.1, "nesterov": True, "momentum": 0.9, "dampening": 0.1}},
            "got momentum = 0.9 and dampening = 0.1",
        ),
        (
            {"type": "Lamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}},
            "optimizer.params.min_coeff = 2 is larger than max_coeff = 1",
        ),
    ],
)
def test_optimizer_cross_param_rules(optimizer, expected):
    assert expected in error({"train_batch_size": 8, "optimizer": optimizer})


def test_sgd_nesterov_accepted_with_momentum():
    p = load(
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}}
    ).optimizer.params
    assert p["nesterov"] and p["momentum"] == 0.9


@pytest.mark.parametrize(
    "kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion", "RMSprop", "Adamax"]
)
def test_unsupported_optimizer_lists_supported(kind):
    msg = error({"train_batch_size": 8, "optimizer": {"type": kind}})
    assert msg.startswith(
        f'optimizer.type = "{kind}": this optimizer is not supported by dsfunc '
        "(supported: Adam, AdamW, SGD, Lamb, Adagrad, Muon)."
    )
