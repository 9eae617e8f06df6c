"""CPU checks of dsfunc.step_scalars: registration (opcheck), the values against float64 arithmetic, the flags on
inf and nan, clipping off, the unscaled path, errors, torch.compile. The CUDA kernel is checked against this
reference bit for bit in test_step_scalars_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch

import dsfunc.kernels as K
from dsfunc.errors import InputError

CASES = [  # sumsq, loss scale, max_norm, unscaled
    (25.0, 1.0, 1.0, True), (0.04, 1.0, 1.0, True), (3.0e7, 65536.0, 0.7, False), (2.5, 1024.0, 0.0, False),
    (0.0, 1.0, 1.0, True), (1.0e-30, 3.0, 2.0, False), (7.0, 1.0, 0.0, True),
]


def _ulps(a: float, b: float) -> int:
    ia, ib = (torch.tensor(x, dtype=torch.float32).view(torch.int32).item() for x in (a, b))
    return abs(ia - ib)


@pytest.mark.parametrize("case", CASES)
def test_opcheck(case):
    sumsq, scale, max_norm, unscaled = case
    torch.library.opcheck(torch.ops.dsfunc.step_scalars.default,
                          (torch.tensor(sumsq), torch.tensor(scale), max_norm, unscaled))


@pytest.mark.parametrize("case", CASES)
def test_values_equal_float64_to_fp32_rounding(case):
    sumsq, scale, max_norm, unscaled = case
    finite, skip, norm, factor, skipped = K.step_scalars(torch.tensor(sumsq), torch.tensor(scale), max_norm, unscaled)
    assert bool(finite) and not bool(skip) and int(skipped) == 0 and skipped.dtype == torch.int32
    want_norm = math.sqrt(sumsq) / scale
    clip = max(1.0, (want_norm + 1e-6) / max_norm) if max_norm > 0 else 1.0
    assert _ulps(float(norm), want_norm) <= 1
    assert _ulps(float(factor), 1.0 / (scale * clip)) <= 3  # four fp32 roundings on the way


@pytest.mark.parametrize("sumsq", [math.inf, math.nan])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_a_non_finite_sum_skips(sumsq, max_norm):
    finite, skip, norm, factor, skipped = K.step_scalars(torch.tensor(sumsq), torch.tensor(8.0), max_norm, False)
    assert not bool(finite) and bool(skip) and int(skipped) == 1
    assert math.isnan(float(norm)) if math.isnan(sumsq) else float(norm) == math.inf
    if max_norm > 0:  # the clip coefficient is inf or nan: the factor is 0 or nan, and the step is skipped anyway
        assert float(factor) == 0.0 if sumsq == math.inf else math.isnan(float(factor))


def test_no_clipping_below_the_norm_and_exactly_the_loss_scale_without_it():
    *_, factor = K.step_scalars(torch.tensor(0.25), torch.tensor(4.0), 1.0, False)[:4]
    assert float(factor) == 0.25  # norm 0.125 < 1: the factor only unscales
    *_, factor = K.step_scalars(torch.tensor(1e12), torch.tensor(4.0), 0.0, False)[:4]
    assert float(factor) == 0.25


@pytest.mark.parametrize("bad", ["float64 sumsq", "1-d scale", "two devices"])
def test_says_what_is_wrong_with_its_input(bad):
    sumsq, scale = torch.tensor(1.0), torch.tensor(1.0)
    if bad == "float64 sumsq":
        sumsq, match = sumsq.double(), "sumsq must be a 0-d float32 tensor, got torch.float64"
    elif bad == "1-d scale":
        scale, match = scale.reshape(1), r"loss_scale must be a 0-d float32 tensor, .* shape \(1,\)"
    else:
        scale, match = scale.to("meta"), "loss_scale is on meta but sumsq on cpu"
    with pytest.raises(InputError, match=match):
        K.step_scalars(sumsq, scale, 1.0, False)


def test_torch_compile_traces_through():
    def scalars(sumsq, scale):
        return K.step_scalars(sumsq, scale, 0.5, False)

    args = torch.tensor(9.0), torch.tensor(2.0)
    compiled = torch.compile(scalars, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*args), scalars(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)
