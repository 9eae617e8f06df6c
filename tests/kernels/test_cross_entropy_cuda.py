"""GPU checks of ``dsfunc_cuda::cross_entropy_rows_`` (ops/cross_entropy.cu) and of ``linear_cross_entropy`` on
CUDA (skipped without CUDA): the kernel against the plain-torch rows on fresh random logits of awkward shapes
in every dtype, the op's registration on CUDA, and the full op against ``F.cross_entropy`` at the 124m
benchmark's head, with its peak memory below that of the fp32 logits alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dsfunc.kernels as K
from dsfunc.kernels.cross_entropy import _rows_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert K.fused_adam_available("cuda"), "the CUDA kernels of ops/ did not build: see the logged reason"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (37, 50304), (64, 1001), (5, 65537)])
def test_rows_kernel_matches_the_reference(dtype, rows, vocab):
    g = torch.Generator(device="cuda").manual_seed(rows * 131 + vocab)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    target[::3] = -100
    scale = torch.tensor(1 / 7, device="cuda")
    want_logits = logits.clone()
    want = _rows_reference(want_logits, target, scale, -100, True)
    got_logits = logits.clone()
    got = torch.ops.dsfunc_cuda.cross_entropy_rows_.default(got_logits, target, scale, -100, True)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert _rel(got_logits, want_logits) <= tol if want_logits.abs().sum() > 0 else torch.equal(got_logits, want_logits)
    untouched = logits.clone()
    loss_only = torch.ops.dsfunc_cuda.cross_entropy_rows_.default(untouched, target, scale, -100, False)
    assert torch.equal(untouched, logits) and torch.equal(loss_only, got)


def test_rows_kernel_on_an_unaligned_view_and_a_bad_target():
    base = torch.randn(4 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    logits = base[1:].view(4, 1024)  # 2 bytes off a 16-byte boundary: the scalar path
    target = torch.tensor([0, 1023, 5, 1024], device="cuda")
    ref = logits.clone()
    want = _rows_reference(ref[:3], target[:3], torch.tensor(0.5, device="cuda"), -100, True)
    got = torch.ops.dsfunc_cuda.cross_entropy_rows_.default(logits, target, torch.tensor(0.5, device="cuda"), -100, True)
    assert torch.allclose(got[:3], want, rtol=1e-5, atol=1e-5) and _rel(logits[:3], ref[:3]) < 1e-2
    assert torch.isnan(got[3])  # a target outside [0, vocab)


@pytest.mark.parametrize("with_grad", [True, False])
def test_opcheck_on_cuda(with_grad):
    h = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=with_grad)
    w = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=with_grad)
    t = torch.randint(0, 1000, (40,), device="cuda")
    torch.library.opcheck(torch.ops.dsfunc.linear_cross_entropy.default, (h, w, t, -100, 16, with_grad))


def test_the_124m_head_against_cross_entropy_and_its_memory():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, vocab = 8192, 768, 50304
    h = torch.randn(n, d, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, d, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    want = F.cross_entropy((h @ w.t()).float(), t)
    want.backward()
    want_h, want_w = h.grad, w.grad
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = K.linear_cross_entropy(h, w, t)
    got.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert abs(float(got.detach() - want.detach())) < 1e-3
    assert _rel(h.grad, want_h) < 1e-2 and _rel(w.grad, want_w) < 1e-2
    assert extra < n * vocab * 4, f"peak {extra / 2**30:.2f} GiB above the inputs: the fp32 logits' size or more"
