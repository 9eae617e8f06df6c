"""GPU checks of the CUDA kernels in ops/ against the plain-torch reference (skipped without CUDA).

Fresh random inputs of awkward sizes with inf/nan injected; relative error (norm-wise over the
finite elements) under 1e-6 in fp32, NaN and inf exactly where the reference has them; the skip flag
leaves every byte unchanged; the bf16/fp16 output equals the new params cast down."""

from __future__ import annotations

import pytest
import torch

import dsfunc.kernels as K
from dsfunc.errors import InputError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SIZES = [1, 3, 4097, 10**7 + 1]


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert K.fused_adam_available("cuda"), "the CUDA kernels of ops/ did not build: see the logged reason"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_rel_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-6) -> None:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN in different places"
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf]), "inf in different places"
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).norm()
    assert err <= rtol * want[fin].norm(), f"relative error {float(err / want[fin].norm()):.3g}"


def _poison_nonfinite(t: torch.Tensor, gen: torch.Generator) -> None:
    """inf/nan at ~0.1% of the places (one nan at index 1 in small tensors; none when n == 1)."""
    n = t.numel()
    if n < 1000:
        if n >= 3:
            t[1] = float("nan")
        return
    idx = torch.randint(0, n, (n // 1000,), generator=gen)
    t[idx[: len(idx) // 2]] = float("inf")
    t[idx[len(idx) // 2 :]] = float("nan")
    t[-1] = float("-inf")


def _adam_case(n: int, seed: int, lowp_dtype, offsets: dict | None = None, nonfinite: bool = True,
               grad_dtype=torch.float32):
    """CPU inputs, and device copies that are views `offsets[name]` elements into larger buffers."""
    gen = torch.Generator().manual_seed(seed)
    cpu = {
        "param": torch.randn(n, generator=gen),
        "grad": torch.randn(n, generator=gen) * 4096.0,
        "exp_avg": torch.randn(n, generator=gen) * 0.01,
        "exp_avg_sq": torch.rand(n, generator=gen) * 1e-4,
    }
    if nonfinite:
        _poison_nonfinite(cpu["grad"], gen)
    cpu["grad"] = cpu["grad"].to(grad_dtype)
    if lowp_dtype is not None:
        cpu["lowp"] = torch.randn(n, generator=gen).to(lowp_dtype)  # poison: every element must be written
    dev = {}
    for name, t in cpu.items():
        off = (offsets or {}).get(name, 0)
        buf = torch.full((n + off + 8,), 7.0, dtype=t.dtype, device="cuda")  # 7: a guard outside the view
        dev[name] = buf[off : off + n]
        dev[name].copy_(t)
    step = float(torch.randint(1, 2000, (1,), generator=gen))
    scalars = {
        "grad_scale": torch.tensor(1.0 / 4096.0 / 1.3),
        "lr": torch.tensor(1e-3 * float(torch.rand((), generator=gen) + 0.5)),
        "step": torch.tensor(step),
        "skip": torch.tensor(False),
    }
    return cpu, dev, scalars


def _run(tensors: dict, scalars: dict, device: str, **hyper) -> None:
    K.adam_step_(
        tensors["param"],
        tensors["grad"],
        tensors["exp_avg"],
        tensors["exp_avg_sq"],
        lowp=tensors.get("lowp"),
        **{k: v.to(device) for k, v in scalars.items()},
        **hyper,
    )


HYPERS = [
    {
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "adam_w_mode": True,
        "bias_correction": True,
    },
    {
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-6,
        "weight_decay": 0.1,
        "adam_w_mode": False,
        "bias_correction": True,
    },
    {
        "beta1": 0.8,
        "beta2": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "adam_w_mode": True,
        "bias_correction": False,
    },
]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hyper", range(len(HYPERS)))
def test_adam_matches_reference(n, lowp_dtype, hyper):
    if n > 10**6 and hyper != 0 and lowp_dtype is not None:
        pytest.skip(
            "the large size runs every optimizer mode once, without lowp, and with bf16/fp16 in mode 0"
        )
    cpu, dev, scalars = _adam_case(n, seed=17 * n + hyper, lowp_dtype=lowp_dtype)
    _run(cpu, scalars, "cpu", **HYPERS[hyper])
    versions = dev["param"]._version
    _run(dev, scalars, "cuda", **HYPERS[hyper])
    torch.cuda.synchronize()
    assert dev["param"]._version > versions
    for name in ("param", "exp_avg", "exp_avg_sq"):
        _assert_rel_close(dev[name], cpu[name])
    assert torch.equal(dev["grad"].cpu().isnan(), cpu["grad"].isnan())  # grad untouched
    if lowp_dtype is not None:
        _assert_lowp_is_param_cast(dev["lowp"], dev["param"])


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hyper", range(len(HYPERS)))
def test_the_host_kernel_updates_bit_for_bit_like_this_one(hyper, grad_dtype, lowp_dtype):
    """ZeRO-Offload's CPU kernel (ops/adam_cpu.cpp) shares this kernel's element arithmetic (ops/adam_math.h):
    an offloaded update writes the numbers a resident one would."""
    from dsfunc.optim.host_adam import host_adam_

    cpu, dev, scalars = _adam_case(4097 * 33, seed=hyper, lowp_dtype=lowp_dtype, grad_dtype=grad_dtype)
    host_adam_([cpu["param"]], [cpu["grad"]], [cpu["exp_avg"]], [cpu["exp_avg_sq"]], lowp=[cpu["lowp"]],
               **scalars, **HYPERS[hyper])
    _run(dev, scalars, "cuda", **HYPERS[hyper])
    for name in ("param", "exp_avg", "exp_avg_sq", "lowp"):
        got, want = dev[name].cpu(), cpu[name]
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), name
        assert torch.equal(_bits(got)[~nan], _bits(want)[~nan]), name


def _assert_lowp_is_param_cast(lowp: torch.Tensor, param: torch.Tensor) -> None:
    want = param.to(lowp.dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(lowp), nan)
    assert torch.equal(_bits(lowp)[~nan], _bits(want)[~nan])


ALL = ("param", "grad", "exp_avg", "exp_avg_sq")


@pytest.mark.parametrize(
    "offsets",
    [
        {**dict.fromkeys(ALL, 1), "lowp": 1},  # 31-element head, then everything aligned
        {**dict.fromkeys(ALL, 3), "lowp": 2},  # 29-element head, lowp realigned by 1 element
        dict.fromkeys(ALL, 2),  # 30-element head, lowp realigned by 2 elements
        {"lowp": 1},  # no head, lowp realigned by 3 elements
        {"grad": 1},  # grad misaligned against param: scalar path
        {"exp_avg_sq": 2, "lowp": 3},  # scalar path
    ],
)
@pytest.mark.parametrize("n", [5, 4097, 1_000_003])
@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adam_unaligned_views(n, offsets, lowp_dtype, grad_dtype):
    """Every path of the kernel (head, vector, realigned lowp, scalar), a 16-bit gradient read as it is too."""
    cpu, dev, scalars = _adam_case(n, seed=n + len(offsets), lowp_dtype=lowp_dtype, offsets=offsets,
                                   grad_dtype=grad_dtype)
    _run(cpu, scalars, "cpu", **HYPERS[0])
    _run(dev, scalars, "cuda", **HYPERS[0])
    for name, view in dev.items():  # nothing written outside the views
        off = offsets.get(name, 0)
        assert (view._base[:off] == 7).all() and (view._base[off + n :] == 7).all(), name
    for name in ("param", "exp_avg", "exp_avg_sq"):
        _assert_rel_close(dev[name], cpu[name])
    _assert_lowp_is_param_cast(dev["lowp"], dev["param"])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1])
def test_adam_skip_leaves_every_byte_unchanged(n, lowp_dtype, offset):
    _, dev, scalars = _adam_case(n, seed=n, lowp_dtype=lowp_dtype, offsets=dict.fromkeys(ALL, offset))
    scalars["skip"] = torch.tensor(True)
    before = {k: v.clone() for k, v in dev.items()}
    _run(dev, scalars, "cuda", **HYPERS[1])
    for name, t in dev.items():
        assert torch.equal(_bits(t), _bits(before[name])), name


def test_adam_repeated_steps_track_reference():
    cpu, dev, scalars = _adam_case(100_003, seed=3, lowp_dtype=torch.bfloat16, nonfinite=False)
    for t in range(1, 21):
        scalars["step"] = torch.tensor(float(t))
        scalars["skip"] = torch.tensor(t % 7 == 0)
        _run(cpu, scalars, "cpu", **HYPERS[0])
        _run(dev, scalars, "cuda", **HYPERS[0])
    for name in ("param", "exp_avg", "exp_avg_sq"):
        _assert_rel_close(dev[name], cpu[name])


def test_adam_from_zero_equals_float64_adam_to_float32_rounding():
    """The kernel's bias corrections, like the reference's, are float64 values rounded once (issue 13)."""
    from tests.kernels.test_kernels import adam_from_zero_in_float64

    adam_from_zero_in_float64("cuda")


def _sum_case(seed: int, nonfinite: str = "") -> list[torch.Tensor]:
    """CUDA tensors of every dtype and awkward size, views at every alignment, one non-contiguous,
    and 500 small ones; optionally inf/nan injected."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    tensors = []
    for i, n in enumerate(SIZES + [0, 4097, 33, 2 * 4097]):
        base = torch.randn(n + 3, generator=gen).to(dtypes[i % 3]).cuda()
        tensors.append(base[i % 4 : i % 4 + n])
    tensors.append(torch.randn(64, 48, generator=gen).cuda().t())
    sizes = torch.randint(1, 300, (500,), generator=gen).tolist()
    tensors += [torch.randn(k, generator=gen).to(torch.bfloat16).cuda() for k in sizes]
    big = tensors[3]  # 10**7 + 1 elements, bf16
    if nonfinite in ("inf", "both"):
        big[int(torch.randint(0, big.numel(), (1,), generator=gen))] = float("inf")
    if nonfinite in ("nan", "both"):
        tensors[-1][0] = float("nan")
    if nonfinite == "tail-inf":
        big[-1] = float("-inf")
    return tensors


def _float64_sum_of_squares(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().square().sum()) for t in tensors)


@pytest.mark.parametrize("seed", [0, 1])
def test_sum_of_squares_matches_float64(seed):
    tensors = _sum_case(seed)
    want = _float64_sum_of_squares(tensors)
    got = K.sum_of_squares(tensors)
    assert got.device.type == "cuda" and got.dtype == torch.float32 and got.dim() == 0
    assert abs(float(got) - want) <= 1e-6 * want, (float(got), want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_single_tensor(n, dtype):
    gen = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=gen).to(dtype)
    want = float(t.double().square().sum())
    got = float(K.sum_of_squares([t.cuda()]))
    assert abs(got - want) <= 1e-6 * want


@pytest.mark.parametrize("kind", ["inf", "nan", "both", "tail-inf"])
def test_sum_of_squares_nonfinite(kind):
    got = K.sum_of_squares(_sum_case(5, kind))
    assert (torch.isnan(got) if kind in ("nan", "both") else torch.isposinf(got)).item()


def test_sum_of_squares_is_deterministic():
    tensors = _sum_case(9)
    first = K.sum_of_squares(tensors)
    assert all(torch.equal(_bits(first), _bits(K.sum_of_squares(tensors))) for _ in range(5))


def test_sum_of_squares_empty_tensors_give_zero_on_device():
    got = K.sum_of_squares(
        [torch.empty(0, device="cuda"), torch.empty(0, 3, device="cuda", dtype=torch.bfloat16)]
    )
    assert got.device.type == "cuda" and float(got) == 0.0


@pytest.mark.parametrize("case", ["float64", "two devices"])
def test_sum_of_squares_says_what_is_wrong_with_its_input(case):
    good = torch.ones(3, device="cuda")
    bad = good.double() if case == "float64" else torch.ones(3)
    with pytest.raises(InputError, match="float64" if case == "float64" else "is on cpu"):
        K.sum_of_squares([good, bad])


def test_adam_refuses_bad_shards_before_writing_any():
    from tests.kernels.test_kernels import _inputs

    p, g, m, v, _, s = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _inputs(8, 0))
    s = {k: t.cuda() for k, t in s.items()}
    before = [t.clone() for t in (p, m, v)]
    with pytest.raises(ValueError, match=r"grad must be a 1-D contiguous .* \(shard 1\)"):
        K.adam_steps_([p, p.clone()], [g, g.view(2, 4)], [m, m.clone()], [v, v.clone()], **s)
    with pytest.raises(ValueError, match="every shard must be on one device, but shard 1 is on cpu"):
        K.adam_steps_([p, p.cpu()], [g, g.cpu()], [m, m.cpu()], [v, v.cpu()], **s)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v)))  # shard 0 was not updated
