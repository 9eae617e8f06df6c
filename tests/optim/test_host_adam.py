"""The host Adam of ZeRO-Offload against torch.optim.AdamW, and its 16-bit gradients widened exactly."""

from __future__ import annotations

import torch

from dsfunc.optim.host_adam import host_adam_

HYPER = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "adam_w_mode": True}


def shards(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in (1000, 37, 4096)]
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (1000, 37, 4096)]
    return params, grads


def step(params, grads, *, steps: int = 3, scale: float = 4.0, skip: bool = False):
    params = [p.clone() for p in params]
    mu, nu = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for i in range(steps):
        host_adam_(params, [g.clone() for g in grads], mu, nu, grad_divisor=torch.tensor(scale),
                   lr=torch.tensor(1e-2), step=torch.tensor(float(i + 1)), skip=torch.tensor(skip), **HYPER)
    return params


def test_host_adam_matches_torch_adamw():
    params, grads = shards()
    got = step(params, [g.float() * 4.0 for g in grads])  # scaled by 4, divided by grad_divisor
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        for p, g in zip(ref, grads):
            p.grad = g.float()
        opt.step()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


def test_16_bit_gradients_update_exactly_like_their_fp32_values():
    params, grads = shards(1)
    widened = step(params, [g.float() for g in grads])
    narrow = step(params, grads)
    assert all(torch.equal(a, b) for a, b in zip(narrow, widened))
    assert all(torch.equal(a, b) for a, b in zip(step(params, grads, skip=True), params))  # skip writes nothing


def test_chunks_update_bit_for_bit_like_one_call_per_unit_and_write_the_16_bit_copy():
    """Each unit goes through the fused kernel a chunk at a time (widened, updated and cast while in cache):
    the same numbers as one call over the whole unit (with a power-of-two thread count: host_adam's note)."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    g = torch.Generator().manual_seed(2)
    sizes = (10_000, 37, 4096 * 3 + 5)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    out = {}
    for chunk in (1 << 12, 1 << 30):
        p = [t.clone() for t in params]
        mu, nu = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
        lowp = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        done = []
        for i in range(2):
            host_adam_(p, grads, mu, nu, grad_divisor=torch.tensor(2.0), lr=torch.tensor(1e-2),
                       step=torch.tensor(float(i + 1)), skip=torch.tensor(False), lowp=lowp, done=done.append,
                       chunk=chunk, **HYPER)
        assert done == [0, 1, 2] * 2
        assert all(torch.equal(w, t.to(torch.bfloat16)) for w, t in zip(lowp, p))
        out[chunk] = (p, mu, nu)
    for a, b in zip(out[1 << 12], out[1 << 30]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
