"""The CUDA kernel of dsfunc.step_scalars against the torch ops it replaced, run on the GPU, bit for bit (skipped
without CUDA). Not against them on the CPU: torch's CPU ``sqrt`` is not always correctly rounded (0.6% of floats in
[0, 1) differ by one ulp), its CUDA one is, as the kernel's ``__fsqrt_rn``."""

from __future__ import annotations

import math

import pytest
import torch

import dsfunc.kernels as K
from dsfunc.kernels.step_scalars import _reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert K.fused_adam_available("cuda"), "the CUDA kernels of ops/ did not build: see the logged reason"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("unscaled", [True, False])
@pytest.mark.parametrize("max_norm", [0.0, 1.0, 0.7, 3.3e-3, 1e9])
def test_the_kernel_equals_the_reference_bit_for_bit(max_norm, unscaled):
    gen = torch.Generator().manual_seed(int(max_norm * 1000) + unscaled)
    sums = torch.cat([10.0 ** torch.empty(200).uniform_(-30, 30, generator=gen), torch.rand(50, generator=gen),
                      torch.tensor([0.0, math.inf, math.nan, 3.4e38])])
    scales = [1.0] if unscaled else [1.0, 65536.0, 2.0 ** -10, 3.7]
    for scale in scales:
        for sumsq in sums:
            args = (sumsq.cuda(), torch.tensor(scale, device="cuda"), max_norm, unscaled)
            want, got = _reference(*args), K.step_scalars(*args)
            for g, w in zip(got, want):
                assert g.is_cuda and g.dtype == w.dtype and torch.equal(_bits(g), _bits(w)), (
                    float(sumsq), scale, got, want)


def test_capturable_in_a_cuda_graph():
    sumsq, scale = torch.tensor(400.0, device="cuda"), torch.tensor(2.0, device="cuda")
    K.step_scalars(sumsq, scale, 1.0, False)  # warm up (builds, allocates) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.step_scalars(sumsq, scale, 1.0, False)
    sumsq.fill_(math.inf)
    graph.replay()
    assert not bool(out[0]) and int(out[4]) == 1
    sumsq.fill_(16.0)
    graph.replay()
    assert bool(out[0]) and float(out[2]) == 2.0
