"""The host Adam of ZeRO-Offload (dsfunc's CPU kernel, ops/adam_cpu.cpp) against torch.optim and the op's
plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from dsfunc import kernels
from dsfunc.errors import InputError
from dsfunc.kernels import adam as adam_op
from dsfunc.kernels.native import native_ready
from dsfunc.optim.host_adam import host_adam_

HYPER = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "adam_w_mode": True}
SIZES = (100_003, 37, 4096)  # the first spreads over threads (at::parallel_for), with a ragged end


def shards(seed: int = 0, grad_dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in SIZES]
    grads = [torch.randn(n, generator=g).to(grad_dtype) for n in SIZES]
    return params, grads


def run(params, grads, *, steps: int = 3, scale: float = 4.0, skip: bool = False, lowp_dtype=None,
        lr_value: float = 1e-2, **hyper):
    params = [p.clone() for p in params]
    mu, nu = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    lowp = None if lowp_dtype is None else [torch.full_like(p, 7.0, dtype=lowp_dtype) for p in params]
    done = []
    for i in range(steps):
        host_adam_(params, [g.clone() for g in grads], mu, nu, grad_scale=torch.tensor(1 / scale),
                   lr=torch.tensor(lr_value), step=torch.tensor(float(i + 1)), skip=torch.tensor(skip), lowp=lowp,
                   done=done.append, **{**HYPER, **hyper})
    assert done == list(range(len(params))) * steps
    return params, mu, nu, lowp


def test_the_cpu_kernel_is_built_here():
    """CI has a compiler: the tests below check the kernel, not the reference it falls back to."""
    assert native_ready("cpu")


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_host_adam_matches_torch_optim(adam_w_mode):
    params, grads = shards()
    got, *_ = run(params, [g.float() * 4.0 for g in grads], adam_w_mode=adam_w_mode)  # scaled by 4, scale 1/4
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    make = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = make(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        for p, g in zip(ref, grads):
            p.grad = g.float()
        opt.step()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hyper", [{}, {"adam_w_mode": False}, {"weight_decay": 0.0}, {"bias_correction": False}])
def test_kernel_agrees_with_the_reference_op(hyper):
    """The CUDA kernel's element arithmetic (ops/adam_math.h), which follows the reference's operations: equal
    to float32 rounding."""
    params, grads = shards(1, torch.float32)
    got = run(params, grads, **hyper)
    ref = [p.clone() for p in params], [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for i in range(3):
        for p, g, m, v in zip(*ref[:1], grads, *ref[1:]):
            kernels.adam_step_(p, g, m, v, grad_scale=torch.tensor(0.25), lr=torch.tensor(1e-2),
                               step=torch.tensor(float(i + 1)), skip=torch.tensor(False), **{**HYPER, **hyper})
    for mine, theirs in zip(got[:3], ref):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gradients_update_exactly_like_their_fp32_values_and_the_copy_is_the_cast(grad_dtype, lowp_dtype):
    params, grads = shards(2, grad_dtype)
    narrow = run(params, grads, lowp_dtype=lowp_dtype)
    widened = run(params, [g.float() for g in grads])
    for mine, theirs in zip(narrow[:3], widened[:3]):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert all(torch.equal(low, p.to(lowp_dtype)) for low, p in zip(narrow[3], narrow[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_conversions_are_exact_at_the_edges(dtype):
    """Every 16-bit bit pattern read as a gradient (subnormals, infinities, NaNs) updates as its fp32 value does,
    and the copy rounds as torch's cast where rounding is hardest: halfway cases, subnormals, overflow. fp16 is
    converted a block at a time (F16C), bf16 element by element; the sizes leave ragged blocks and vectors."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    g16 = torch.cat([patterns, patterns[:1027]])
    params = [torch.randn(g16.numel(), generator=torch.Generator().manual_seed(6))]
    narrow = run(params, [g16], steps=1, lowp_dtype=dtype)
    widened = run(params, [g16.float()], steps=1, lowp_dtype=dtype)
    for mine, theirs in zip(narrow, widened):
        assert torch.equal(mine[0].view(torch.int32 if mine[0].dtype == torch.float32 else torch.int16),
                           theirs[0].view(torch.int32 if theirs[0].dtype == torch.float32 else torch.int16))

    # lr 0 and no decay leave each parameter as it was: the copy is then the cast of these values.
    info = torch.finfo(dtype)
    step = torch.tensor([info.tiny, info.eps, 1.0, info.max, info.smallest_normal / 1024])
    base = torch.randn(4093, generator=torch.Generator().manual_seed(7))
    values = torch.cat([
        (base[:, None] * step).reshape(-1),  # normals, subnormals, beyond the largest finite value
        torch.tensor([1.0, 2.0, 1024.0]).to(dtype).float().nextafter(torch.tensor(float("inf"))),
        (torch.arange(1, 2049, dtype=torch.float32) + 0.5) * info.eps,  # halfway between two 16-bit values
        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), info.max * 1.0001]),
    ])
    p, _, _, low = run([values], [torch.zeros_like(values)], steps=1, lowp_dtype=dtype, weight_decay=0.0,
                       lr_value=0.0)
    assert torch.equal(p[0], values)
    assert torch.equal(low[0].view(torch.int16), values.to(dtype).view(torch.int16))


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_new_parameters_written_over_the_gradient_are_those_written_apart(dtype, adam_w_mode):
    """ZeRO-Offload writes a unit's new 16-bit shard over the 16-bit gradient it was computed from (lowp is grad):
    every element is read before it is overwritten, by every thread, so nothing changes."""
    params, grads = shards(6, dtype)
    apart = run(params, grads, steps=1, lowp_dtype=dtype, adam_w_mode=adam_w_mode)
    over = [p.clone() for p in params], [g.clone() for g in grads]
    mu, nu = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    host_adam_(over[0], over[1], mu, nu, grad_scale=torch.tensor(1 / 4.0), lr=torch.tensor(1e-2),
               step=torch.tensor(1.0), skip=torch.tensor(False), lowp=over[1], **{**HYPER, "adam_w_mode": adam_w_mode})
    for mine, theirs in zip((over[0], mu, nu, over[1]), apart):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_new_parameters_that_overlap_the_gradient_otherwise_are_refused():
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match="lowp must be grad itself"):
        host_adam_([p], [g], [torch.zeros(8)], [torch.zeros(8)], grad_scale=torch.tensor(1.0), lr=torch.tensor(1.0),
                   step=torch.tensor(1.0), skip=torch.tensor(False), lowp=[g.view(torch.bfloat16)[:8]], **HYPER)


def test_skip_writes_nothing():
    params, grads = shards(3)
    p, mu, nu, lowp = run(params, grads, skip=True, lowp_dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(p, params))
    assert all(not t.any() for t in mu + nu) and all((t == 7.0).all() for t in lowp)


def test_the_result_does_not_depend_on_the_thread_count():
    """Each thread updates a contiguous range element by element: the split changes nothing."""
    params, grads = shards(4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(params, grads)
        torch.set_num_threads(2)
        two = run(params, grads)
    finally:
        torch.set_num_threads(before)
    for mine, theirs in zip(one[:3], two[:3]):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_without_the_kernel_the_reference_runs(monkeypatch):
    params, grads = shards(5)
    native = run(params, grads, lowp_dtype=torch.bfloat16)
    monkeypatch.setattr(adam_op, "native_ready", lambda kind: False)
    reference = run(params, grads, lowp_dtype=torch.bfloat16)
    for a, b in zip(native[0], reference[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bad_input_says_what_is_wrong():
    p, g = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(InputError, match="grad must be a 1-D contiguous float32 or bfloat16 or float16 tensor"):
        host_adam_([p], [g], [torch.zeros(4)], [torch.zeros(4)], grad_scale=torch.tensor(1.0), lr=torch.tensor(1.0),
                   step=torch.tensor(1.0), skip=torch.tensor(False), **HYPER)


@pytest.mark.parametrize("native", [True, False])
def test_an_update_reading_sources_writes_elsewhere_what_it_writes_in_place(native, monkeypatch):
    """The speculative update's form (dsfunc.zero.offload.speculation): reading the live state and writing spare
    buffers gives, bit for bit, the in-place update, and leaves the state as it was; the kernel or its reference."""
    if not native:
        monkeypatch.setattr(adam_op, "native_ready", lambda kind: False)
    params, grads = shards(6)
    g = torch.Generator().manual_seed(7)
    live = [params[0], torch.randn(SIZES[0], generator=g) * 0.1, torch.rand(SIZES[0], generator=g)]
    before = [t.clone() for t in live]
    spare = [torch.full_like(t, float("nan")) for t in live]
    scalars = (torch.tensor(0.25), torch.tensor(1e-2), torch.tensor(3.0), torch.tensor(False))
    hyper = tuple(HYPER.values()) + (True,)
    adam_op.host_adam_step_(spare[0], grads[0], spare[1], spare[2], None, *scalars, *hyper, sources=live)
    assert all(torch.equal(a, b) for a, b in zip(live, before))
    adam_op.host_adam_step_(live[0], grads[0], live[1], live[2], None, *scalars, *hyper)
    assert not torch.equal(live[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(live, spare))


@pytest.mark.parametrize("kahan", [False, True])
def test_the_bf16_kernel_reading_sources_writes_elsewhere_what_it_writes_in_place(kahan):
    g = torch.Generator().manual_seed(8)
    n = SIZES[0]
    live = [torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 0.1).bfloat16(),
            torch.rand(n, generator=g).bfloat16()] + ([(torch.randn(n, generator=g) * 1e-3).bfloat16()] if kahan else [])
    grad = torch.randn(n, generator=g)
    before, spare = [t.clone() for t in live], [torch.full_like(t, float("nan")) for t in live]
    scalars = (torch.tensor(1.0), torch.tensor(0.5), torch.tensor(1e-2), torch.tensor(3.0), torch.tensor(False))

    def step(t, **sources):
        adam_op.host_adam_bf16_step_(t[0], grad, t[1], t[2], t[3] if kahan else None, *scalars,
                                     *HYPER.values(), True, **sources)

    step(spare, sources=live)
    assert all(torch.equal(a, b) for a, b in zip(live, before))
    step(live)
    assert not torch.equal(live[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(live, spare))
    with pytest.raises(RuntimeError, match="sources must not overlap the tensors the update writes"):
        step(spare, sources=[spare[0], *live[1:]])
