"""The fp16 and bf16 sections: defaults, compute dtype, one precision at a time, bf16 without loss scaling."""

from __future__ import annotations

import pytest
import torch

from dsfunc.config import FP16Config
from tests.config.helpers import error, load


def test_fp16_defaults():
    f = load().fp16
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis) == (
        False,
        0.0,
        16,
        1000,
        2,
    )
    assert (f.consecutive_hysteresis, f.min_loss_scale, f.auto_cast, f.raise_error_at_min_scale) == (
        False,
        1.0,
        False,
        True,
    )
    assert load({"fp16": {"enabled": True}}).fp16 == FP16Config(enabled=True)


@pytest.mark.parametrize(
    "fp16, bf16, dtype",
    [
        (False, False, torch.float32),
        (True, False, torch.float16),
        (False, True, torch.bfloat16),
    ],
)
def test_compute_dtype(fp16, bf16, dtype):
    assert load({"fp16": {"enabled": fp16}, "bf16": {"enabled": bf16}}).compute_dtype == dtype


def test_both_precisions_enabled():
    msg = error({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "bfloat16 and fp16 modes cannot be simultaneously enabled" in msg
    load({"fp16": {"enabled": True}, "bf16": {"enabled": False}})


def test_loss_scaling_keys_in_bf16_are_explained():
    msg = error({"train_batch_size": 8, "bf16": {"enabled": True, "loss_scale_window": 500}})
    assert msg == (
        "bf16.loss_scale_window: loss scaling only applies to fp16; bf16 has the range of fp32 and needs no "
        "loss scale. Remove this key from the bf16 section."
    )


def test_bfloat16_old_name():
    c = load({"bfloat16": {"enabled": True}})
    assert c.bf16.enabled and c.compute_dtype == torch.bfloat16
    msg = error({"train_batch_size": 8, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert msg == '"bf16" and "bfloat16" are two spellings of the same key (bf16); keep one.'
