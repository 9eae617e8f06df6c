"""``dsfunc.kernels.linear_cross_entropy`` against ``F.cross_entropy(hidden @ weight.T)`` on the CPU (the
reference implementation): loss and both gradients, chunked or not, with ignored rows; the op's registration
(opcheck), its fake kernel under ``torch.compile``, autocast, and the GPT's fused loss through ``train_step``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dsfunc
from dsfunc.errors import InputError
from dsfunc.kernels import linear_cross_entropy
from dsfunc.kernels.cross_entropy import default_chunk_rows
from dsfunc.models.gpt import GPT, GPTConfig, init_weights

OP = torch.ops.dsfunc.linear_cross_entropy.default


def _case(rows: int, d: int, vocab: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, d, generator=g) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[::5] = -100
    return h, w, t


def _grads(loss_fn, h, w, t, cotangent=3.0):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = loss_fn(h, w, t)
    (loss * cotangent).backward()
    return loss.detach(), h.grad, w.grad


def _reference(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
def test_matches_cross_entropy_over_the_logits_in_fp32(chunk):
    h, w, t = _case(50, 24, 131)
    got = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=chunk), h, w, t)
    want = _grads(_reference, h, w, t)
    assert got[0].dtype == torch.float32
    assert abs(float(got[0] - want[0])) < 1e-5
    assert _rel(got[1], want[1]) < 1e-5 and _rel(got[2], want[2]) < 1e-5


def test_bf16_matches_within_bf16_rounding_and_3d_hidden_int32_targets():
    h, w, t = _case(64, 32, 300, torch.bfloat16, seed=1)
    h3 = h.detach().view(4, 16, 32).requires_grad_()
    loss = linear_cross_entropy(h3, w, t.view(4, 16).int(), chunk_rows=16)
    loss.backward()
    want = _grads(_reference, h, w, t, cotangent=1.0)
    assert abs(float(loss.detach() - want[0])) < 1e-3 * float(want[0])
    assert _rel(h3.grad.view(64, 32), want[1]) < 1e-2 and _rel(w.grad, want[2]) < 1e-2
    assert h3.grad.dtype == w.grad.dtype == torch.bfloat16


def test_no_grad_and_autocast():
    h, w, t = _case(40, 16, 97)
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(h, w, t, chunk_rows=8), _reference(h, w, t), atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weight, bf16 compute, fp32 gradient
        got = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=8), h, w, t)
        want = _grads(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t), h, w, t)
    assert got[2].dtype == torch.float32
    assert abs(float(got[0] - want[0])) < 1e-3 and _rel(got[1], want[1]) < 1e-2 and _rel(got[2], want[2]) < 1e-2


@pytest.mark.parametrize("with_grad", [True, False])
def test_opcheck(with_grad):
    h, w, t = _case(20, 16, 37, seed=2)
    h, w = h.detach().requires_grad_(with_grad), w.detach().requires_grad_(with_grad)
    torch.library.opcheck(OP, (h, w, t, -100, 6, with_grad))


def test_fake_kernel_under_compile_gives_the_eager_loss_and_gradients():
    h, w, t = _case(48, 16, 50, seed=3)

    def fn(h, w, t):
        return linear_cross_entropy(torch.tanh(h), w, t, chunk_rows=16)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got, want = _grads(compiled, h, w, t), _grads(fn, h, w, t)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_bad_input_says_what_is_wrong():
    h, w, t = _case(8, 4, 10)
    with pytest.raises(InputError, match="share one floating dtype"):
        linear_cross_entropy(h, w.double(), t)
    with pytest.raises(InputError, match="one class per row"):
        linear_cross_entropy(h, w, t[:5])
    with pytest.raises(InputError, match=r"\(vocab, d\)"):
        linear_cross_entropy(h, w[:, :3], t)


def test_default_chunk_is_a_power_of_two_within_the_budget():
    rows = default_chunk_rows(50304, torch.bfloat16)
    assert rows == 4096 and rows * 50304 * 2 <= 512 * 2**20 < 2 * rows * 50304 * 2


def test_gpt_fused_loss_trains_as_the_plain_loss():
    """The tied output projection through the op: the same losses over three dsfunc steps (fp32)."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
    tokens = torch.randint(0, 64, (3, 4, 17), generator=torch.Generator().manual_seed(4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    losses = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**cfg.__dict__, "fused_loss": fused}))
        model.apply(init_weights)
        state = dsfunc.init_state(model, config)
        losses[fused] = []
        for batch in tokens:
            state = dsfunc.train_step(state, (batch[:, :-1], batch[:, 1:]))
            losses[fused].append(float(state.metrics.loss))
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-6)
