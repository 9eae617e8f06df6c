"""CPU checks of dsfunc.kernels: op registration (opcheck), the reference against the optimizer chain
bit for bit, the skip flag, sum_of_squares values and non-finite handling, errors, torch.compile."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import dsfunc.kernels as K


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _inputs(
    n: int, seed: int, lowp_dtype=None, skip: bool = False, step: float = 7.0, nonfinite: bool = False
):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * 1024.0  # raw: still multiplied by the loss scale
    if nonfinite:
        grad[1] = float("inf")
        grad[-2] = float("nan")
    exp_avg = torch.randn(n, generator=gen) * 0.1
    exp_avg_sq = torch.rand(n, generator=gen) * 0.01
    lowp = None if lowp_dtype is None else torch.randn(n, generator=gen).to(lowp_dtype)
    scalars = {
        "grad_scale": torch.tensor(1.0 / 1024.0 / 1.7),
        "lr": torch.tensor(3e-4 * (1 + seed)),
        "step": torch.tensor(step),
        "skip": torch.tensor(skip),
    }
    return param, grad, exp_avg, exp_avg_sq, lowp, scalars


def _optim_chain(param, grad, exp_avg, exp_avg_sq, grad_scale, lr, step, skip, b1, b2, eps, wd, adam_w, bias_corr):
    """The core's update for one flat tensor: scale_by_factor, then dsfunc.optim.adam (scale_by_adam,
    add_decayed_weights, scale_by_learning_rate), apply_updates, and where(skip, old, new)."""
    optim = pytest.importorskip("dsfunc.optim", reason="needs dsfunc.optim (branch optim)")
    tx = optim.chain(optim.scale_by_factor(), optim.adam(float(lr), (b1, b2), eps, wd, bias_corr, adam_w))
    params = {"w": param}
    state = tx.init(params)
    count = (step - 1).to(torch.int64)
    state[1]["adam"] = optim.ScaleByAdamState(count, {"w": exp_avg}, {"w": exp_avg_sq})
    updates, state = tx.update({"w": grad}, state, params, grad_scale=grad_scale)
    new_p = optim.apply_updates(params, updates)["w"]
    adam_state = state[1]["adam"]
    new = (new_p, adam_state.mu["w"], adam_state.nu["w"])
    return [torch.where(skip, old, n) for old, n in zip((param, exp_avg, exp_avg_sq), new)]


MODES = [
    # beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction
    (0.9, 0.999, 1e-8, 0.01, True, True),
    (0.9, 0.95, 1e-6, 0.1, False, True),
    (0.8, 0.99, 1e-8, 0.0, True, False),
    (0.9, 0.999, 0.0, 0.0, False, True),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_reference_equals_optimizer_chain_bitwise(mode, lowp_dtype, nonfinite):
    b1, b2, eps, wd, adam_w, bias_corr = mode
    for seed in range(3):
        param, grad, m, v, lowp, s = _inputs(
            1000 + seed, seed, lowp_dtype, nonfinite=nonfinite, step=1.0 + 41 * seed
        )
        want_p, want_m, want_v = _optim_chain(param, grad, m, v, *s.values(), b1, b2, eps, wd, adam_w, bias_corr)
        K.adam_step_(
            param,
            grad,
            m,
            v,
            lowp=lowp,
            **s,
            beta1=b1,
            beta2=b2,
            eps=eps,
            weight_decay=wd,
            adam_w_mode=adam_w,
            bias_correction=bias_corr,
        )
        assert torch.equal(_bits(param), _bits(want_p))
        assert torch.equal(_bits(m), _bits(want_m))
        assert torch.equal(_bits(v), _bits(want_v))
        if lowp is not None:
            assert torch.equal(_bits(lowp), _bits(want_p.to(lowp_dtype)))
        assert torch.isnan(param).any().item() == nonfinite


@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16])
def test_skip_leaves_every_byte_unchanged(lowp_dtype):
    param, grad, m, v, lowp, s = _inputs(257, 5, lowp_dtype, skip=True, nonfinite=True)
    param[3] = float("nan")
    before = [t.clone() for t in (param, grad, m, v, lowp) if t is not None]
    K.adam_step_(param, grad, m, v, lowp=lowp, **s, weight_decay=0.01)
    after = [t for t in (param, grad, m, v, lowp) if t is not None]
    for old, new in zip(before, after):
        assert torch.equal(_bits(old), _bits(new))


def test_adam_matches_torch_adamw_one_step():
    """Sanity of the math against torch.optim (different rounding order, so a tolerance)."""
    param, grad, m, v, _, s = _inputs(4096, 11, step=1.0)
    m.zero_()
    v.zero_()
    ref = torch.nn.Parameter(param.clone())
    ref.grad = grad * s["grad_scale"]
    opt = torch.optim.AdamW([ref], lr=s["lr"].item(), betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt.step()
    K.adam_step_(param, grad, m, v, **s, weight_decay=0.01)
    torch.testing.assert_close(param, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("beta", [0.9, 0.95, 0.99, 0.999, 0.9999])
def test_bias_corrections_are_the_float32_rounding_of_their_exact_values(beta):
    for t in (1, 2, 3, 10, 1000, 10**5, 10**7):
        bc1, bc2_sqrt = K.adam.bias_corrections(beta, beta, torch.tensor(t))
        assert bc1.dtype == bc2_sqrt.dtype == torch.float32 and bc1.dim() == 0
        assert bc1.item() == torch.tensor(1 - beta**t, dtype=torch.float64).float().item(), t
        assert bc2_sqrt.item() == torch.tensor(math.sqrt(1 - beta**t), dtype=torch.float64).float().item(), t


def adam_from_zero_in_float64(device: str) -> None:
    """A parameter starting at 0 is the sum of its updates, so the first steps' bias corrections show in
    full: in float32, 1 - 0.999 alone is 1.3e-5 off, which made these updates ~6e-6 too small."""
    gen = torch.Generator().manual_seed(5)
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    p, m, v = (torch.zeros(4097, device=device) for _ in range(3))
    p64, m64, v64 = (torch.zeros(4097, dtype=torch.float64) for _ in range(3))
    scalars = {"grad_scale": torch.tensor(1.0), "lr": torch.tensor(lr), "skip": torch.tensor(False)}
    for t in range(1, 4):
        g = torch.randn(4097, generator=gen)
        K.adam_step_(p, g.to(device), m, v, **{k: x.to(device) for k, x in scalars.items()},
                     step=torch.tensor(float(t), device=device), beta1=b1, beta2=b2, eps=eps)
        g64 = g.double()
        m64, v64 = b1 * m64 + (1 - b1) * g64, b2 * v64 + (1 - b2) * g64 * g64
        p64 = p64 - lr * (m64 / (1 - b1**t)) / ((v64 / (1 - b2**t)).sqrt() + eps)
        error = float((p.cpu().double() - p64).norm() / p64.norm())
        assert error < 1e-6, f"step {t}: {error:.3g} relative"


def test_adam_from_zero_equals_float64_adam_to_float32_rounding():
    adam_from_zero_in_float64("cpu")


OPCHECK_CASES = [
    (torch.bfloat16, 0.01, True, True, False),
    (torch.float16, 0.1, False, True, False),
    (None, 0.0, True, False, False),
    (torch.bfloat16, 0.01, True, True, True),
]


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_adam_step(case):
    lowp_dtype, wd, adam_w, bias_corr, skip = case
    param, grad, m, v, lowp, s = _inputs(33, 2, lowp_dtype, skip=skip)
    other = _inputs(9, 3, lowp_dtype, skip=skip)[:5]  # a second shard of another size in the same call
    shards = list(zip((param, grad, m, v, lowp), other))
    params, grads, ms, vs, lowps = ([*pair] for pair in shards)
    args = (params, grads, ms, vs, [] if lowp is None else lowps, *s.values(), 0.9, 0.999, 1e-8, wd, adam_w,
            bias_corr)
    torch.library.opcheck(torch.ops.dsfunc.adam_steps_.default, args)


@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16])
def test_one_call_over_shards_equals_a_call_per_shard_bitwise(lowp_dtype):
    shards = [_inputs(n, seed, lowp_dtype)[:5] for seed, n in enumerate((1, 70, 333))]
    s = _inputs(1, 0)[5]
    each = [[t.clone() if t is not None else None for t in shard] for shard in shards]
    for p, g, m, v, low in each:
        K.adam_step_(p, g, m, v, lowp=low, **s, weight_decay=0.01)
    params, grads, ms, vs, lowps = (list(ts) for ts in zip(*shards))
    K.adam_steps_(params, grads, ms, vs, lowps=() if lowp_dtype is None else lowps, **s, weight_decay=0.01)
    for one, many in zip(each, shards):
        for a, b in zip(one, many):
            assert (a is None and b is None) or torch.equal(_bits(a), _bits(b))


def test_shard_lists_of_different_lengths_are_refused():
    p, g, m, v, low, s = _inputs(8, 0, torch.bfloat16)
    with pytest.raises(ValueError, match="one tensor per shard and lowps none or one per shard, got 2, 1, 2, 2 and 1"):
        K.adam_steps_([p, p.clone()], [g], [m, m.clone()], [v, v.clone()], lowps=[low], **s)
    with pytest.raises(ValueError, match=r"grad must be a 1-D contiguous .* \(shard 1\)"):
        K.adam_steps_([p, p.clone()], [g, g.view(2, 4)], [m, m.clone()], [v, v.clone()], **s)
    on_meta = [t.to("meta") for t in (p, g, m, v)]
    with pytest.raises(ValueError, match="every shard must be on one device, but shard 1 is on meta"):
        K.adam_steps_([p, on_meta[0]], [g, on_meta[1]], [m, on_meta[2]], [v, on_meta[3]], **s)


def test_opcheck_sum_of_squares():
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(5, 7, generator=gen),
        torch.randn(3, generator=gen).to(torch.bfloat16),
        torch.randn(0),
        torch.randn(11, generator=gen).to(torch.float16),
    ]
    torch.library.opcheck(torch.ops.dsfunc.sum_of_squares.default, (tensors,))


def test_sum_of_squares_values():
    gen = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(1, generator=gen),
        torch.randn(3, generator=gen).to(torch.bfloat16),
        torch.randn(4097, generator=gen).to(torch.float16),
        torch.randn(64, 33, generator=gen),
        torch.randn(2, 8, generator=gen).t(),  # non-contiguous
        torch.randn(0, generator=gen),
        torch.tensor(2.5),
    ]
    want = sum(float(t.double().square().sum()) for t in tensors)
    got = K.sum_of_squares(tensors)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(float(got) - want) <= 1e-6 * want


@pytest.mark.parametrize(
    "values, dtype, expect",
    [
        ([1.0, float("inf")], torch.bfloat16, "inf"),
        ([float("-inf"), 2.0], torch.float32, "inf"),
        ([1.0, float("nan")], torch.float16, "nan"),
        ([float("inf"), float("nan")], torch.float32, "nan"),
        ([1e20, 1.0], torch.float32, "inf"),  # the square overflows fp32, as the fp32 accumulation does
    ],
)
def test_sum_of_squares_nonfinite(values, dtype, expect):
    tensors = [torch.randn(100), torch.tensor(values, dtype=dtype), torch.randn(7).to(torch.bfloat16)]
    got = K.sum_of_squares(tensors)
    assert (torch.isnan(got) if expect == "nan" else torch.isposinf(got)).item()


def test_sum_of_squares_empty_list_is_zero():
    got = K.sum_of_squares([])
    assert got.dtype == torch.float32 and float(got) == 0.0


def _bad_adam(name):
    param, grad, m, v, lowp, s = _inputs(8, 0, torch.bfloat16)
    kw = dict(lowp=lowp, **s)
    args = [param, grad, m, v]
    if name == "param dtype":
        args[0] = param.double()
    elif name == "grad 2-D":
        args[1] = grad.view(2, 4)
    elif name == "exp_avg size":
        args[2] = torch.zeros(9)
    elif name == "exp_avg_sq strided":
        args[3] = torch.zeros(16)[::2]
    elif name == "lowp dtype":
        kw["lowp"] = torch.zeros(8)
    elif name == "lr python-like":
        kw["lr"] = torch.tensor([1e-3])
    elif name == "skip dtype":
        kw["skip"] = torch.tensor(0.0)
    elif name == "step device":
        kw["step"] = torch.tensor(1.0, device="meta")
    elif name == "beta":
        kw["beta1"] = 1.0
    return args, kw


@pytest.mark.parametrize(
    "name, message",
    [
        ("param dtype", "param must be a 1-D contiguous float32 tensor"),
        (
            "grad 2-D",
            "grad must be a 1-D contiguous float32 or bfloat16 or float16 tensor (a flat shard), got torch.float32 of",
        ),
        ("exp_avg size", "exp_avg must match param (8 elements on cpu), got 9"),
        ("exp_avg_sq strided", "non-contiguous"),
        ("lowp dtype", "lowp must be a 1-D contiguous bfloat16 or float16 tensor"),
        ("lr python-like", "lr must be a 0-d torch.float32 tensor on cpu"),
        ("skip dtype", "skip must be a 0-d torch.bool tensor"),
        ("step device", "step must be a 0-d torch.float32 tensor on cpu"),
        ("beta", "betas must lie in [0, 1)"),
    ],
)
def test_adam_step_bad_input_says_what_is_wrong(name, message):
    args, kw = _bad_adam(name)
    with pytest.raises(ValueError) as err:
        K.adam_step_(*args, **kw)
    assert message in str(err.value)


def test_sum_of_squares_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="tensor 1 is torch.int64; only float32, bfloat16 and float16"):
        K.sum_of_squares([torch.ones(2), torch.ones(2, dtype=torch.long)])
    with pytest.raises(ValueError, match="tensor 1 is on meta but tensor 0 is on cpu"):
        K.sum_of_squares([torch.ones(2), torch.ones(2, device="meta")])


def test_fused_path_only_on_cuda():
    assert not K.fused_adam_available("cpu")
    assert not K.fused_adam_available(torch.device("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is absent")
def test_missing_cuda_logs_one_line_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(K.native, "_ready", {})
    with caplog.at_level(logging.WARNING, logger="dsfunc.kernels"):
        assert not K.fused_adam_available("cuda")
        assert not K.fused_adam_available("cuda:0")
    [record] = caplog.records
    assert "CUDA kernels unavailable" in record.getMessage()
    assert "reference" in record.getMessage() and "\n" not in record.getMessage()


def test_torch_compile_traces_through_both_ops():
    def step(param, grad, m, v, lowp, grad_scale, lr, t, skip):
        sq = K.sum_of_squares([grad, lowp])
        K.adam_step_(
            param, grad, m, v, lowp=lowp, grad_scale=grad_scale, lr=lr, step=t, skip=skip, weight_decay=0.01
        )
        return sq

    param, grad, m, v, lowp, s = _inputs(64, 3, torch.bfloat16)
    eager = [t.clone() for t in (param, grad, m, v, lowp)]
    want = step(*eager, *s.values())
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(param, grad, m, v, lowp, *s.values())
    assert torch.equal(got, want)
    for a, b in zip((param, grad, m, v, lowp), eager):
        assert torch.equal(_bits(a), _bits(b))


def _build_lock(tmp_path, monkeypatch, age_s: float):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / Path(cpp_extension._get_build_directory("dsfunc_cpu_ops", verbose=False)).name / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_killed_builds_lock_is_named_not_waited_on_forever(tmp_path, monkeypatch, caplog):
    """torch's build waits on a lock file with no end: a build killed midway left one, and every later process
    hung silently."""
    lock = _build_lock(tmp_path, monkeypatch, age_s=2 * K.native.STALE_LOCK_S)
    monkeypatch.setattr(K.native, "_ready", {})
    with caplog.at_level(logging.WARNING, logger="dsfunc.kernels"):
        assert not K.native.native_ready("cpu")
    [record] = caplog.records
    assert f"rm {lock}" in record.getMessage() and "reference" in record.getMessage()
    assert lock.exists()  # another process might still be building: deleting it is the user's call


def test_a_live_builds_lock_is_waited_for(tmp_path, monkeypatch, caplog):
    lock = _build_lock(tmp_path, monkeypatch, age_s=0)
    monkeypatch.setattr(K.native, "ANNOUNCE_AFTER_S", 0.5)
    threading.Timer(1.5, lock.unlink).start()  # the other process's build ends
    with caplog.at_level(logging.WARNING, logger="dsfunc.kernels"):
        assert K.native._stale_lock("cpu") is None
    assert not lock.exists()
    [record] = caplog.records
    assert "waiting for another process's build" in record.getMessage()


def test_a_lock_held_for_a_moment_is_waited_for_silently(tmp_path, monkeypatch, caplog):
    """torch holds the lock briefly on every load of a cached build: a notebook beside another process loading the
    kernels printed a wait to its stderr."""
    lock = _build_lock(tmp_path, monkeypatch, age_s=0)
    monkeypatch.setattr(K.native, "ANNOUNCE_AFTER_S", 60.0)
    threading.Timer(1.0, lock.unlink).start()
    with caplog.at_level(logging.WARNING, logger="dsfunc.kernels"):
        assert K.native._stale_lock("cpu") is None
    assert not lock.exists() and not caplog.records
