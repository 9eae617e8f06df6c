"""dsfunc.optim against torch.optim, the published LAMB rule and hand computations."""

from __future__ import annotations

import math

import optree
import pytest
import torch

from dsfunc.config import ConfigError
from dsfunc.optim import (
    EmptyState,
    ScaleByAdamState,
    ScheduleState,
    Transform,
    adagrad,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    current_lr,
    lamb,
    named_chain,
    optimizer_from_config,
    scale_by_factor,
    sgd,
)
from dsfunc.schedules import one_cycle_momentum, warmup_lr
from tests.cuda_sync import no_host_sync

STEPS = 20
SHAPES = {"w": (7, 5), "b": (5,), "nested": {"k": (2, 3, 4), "s": (1,)}}


def make_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda shape: torch.randn(shape, generator=g), SHAPES,
                           is_leaf=lambda x: isinstance(x, tuple))


def make_grads(seed: int = 1) -> list[dict]:
    return [make_params(seed + 100 * k) for k in range(STEPS)]


def run_ours(tx: Transform, params: dict, grads: list[dict], **extra) -> tuple[dict, object]:
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params, **extra)
        params = apply_updates(params, updates)
    return params, state


def run_torch(make_opt, params: dict, grads: list[dict], before_step=None) -> dict:
    leaves, spec = optree.tree_flatten(params)
    tparams = [torch.nn.Parameter(x.clone()) for x in leaves]
    opt = make_opt(tparams)
    for k, g in enumerate(grads):
        for p, gl in zip(tparams, optree.tree_leaves(g)):
            p.grad = gl.clone()
        if before_step is not None:
            before_step(opt, k)
        opt.step()
    return optree.tree_unflatten(spec, [p.detach() for p in tparams])


def max_rel_diff(a: dict, b: dict) -> float:
    """max over leaves of max|a - b| / max|b|."""
    diffs = optree.tree_map(lambda x, y: ((x - y).abs().max() / y.abs().max()).item(), a, b)
    return max(optree.tree_leaves(diffs))


def assert_moved(before: dict, after: dict, at_least: float = 1e-3) -> None:
    """Guard against a comparison that passes because nothing happened."""
    assert max_rel_diff(after, before) > at_least


# ----------------------------------------------------------------------------------------------- torch.optim parity

@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_l2_matches_torch_adam(wd):
    params, grads = make_params(), make_grads()
    ours, _ = run_ours(adam(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, adam_w_mode=False),
                       params, grads)
    ref = run_torch(lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd),
                    params, grads)
    assert_moved(params, ref)
    assert max_rel_diff(ours, ref) <= 1e-6


@pytest.mark.parametrize("make", [lambda: adamw(lr=1e-2, weight_decay=0.1),
                                  lambda: adam(lr=1e-2, weight_decay=0.1, adam_w_mode=True),
                                  lambda: adam(lr=1e-2, weight_decay=0.1)],
                         ids=["adamw", "adam_w_mode", "adam_default"])
def test_decoupled_adam_matches_torch_adamw(make):
    params, grads = make_params(), make_grads()
    ours, _ = run_ours(make(), params, grads)
    ref = run_torch(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), params, grads)
    assert_moved(params, ref)
    assert max_rel_diff(ours, ref) <= 1e-6
    l2 = run_torch(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1), params, grads)
    assert max_rel_diff(ours, l2) > 1e-4  # the two decay modes really differ on this data


def test_adam_without_bias_correction_is_the_plain_moment_ratio():
    params, grads = make_params(), make_grads()[:2]
    ours, state = run_ours(adam(lr=0.1, betas=(0.5, 0.75), eps=1e-3, bias_correction=False), params, grads)
    expected = {}
    for name in ("w", "b"):
        m = v = torch.zeros_like(params[name])
        p = params[name]
        for g in grads:
            m = 0.5 * m + 0.5 * g[name]
            v = 0.75 * v + 0.25 * g[name] ** 2
            p = p - 0.1 * m / (v.sqrt() + 1e-3)
        expected[name] = p
    assert max_rel_diff({k: ours[k] for k in expected}, expected) <= 1e-6
    assert state["adam"].count.item() == 2


def test_adam_follows_the_documented_call_sequence_bit_for_bit():
    """The fused kernel mirrors the docstring's sequence; the transform must be exactly that sequence."""
    b1, b2, eps, wd, lr = 0.9, 0.999, 1e-8, 0.01, 3e-3
    params, grads = make_params(), make_grads()[:3]
    tx = adam(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    state = tx.init(params)
    p, m, v = params["w"], torch.zeros_like(params["w"]), torch.zeros_like(params["w"])
    for k, g in enumerate(grads):
        updates, state = tx.update(g, state, params)
        params = apply_updates(params, updates)
        gw = g["w"]
        m = m.mul(b1).add(gw, alpha=1 - b1)
        v = v.mul(b2).addcmul(gw, gw, value=1 - b2)
        t = (torch.tensor(k, dtype=torch.int64) + 1).to(torch.float32)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        u = (m / bc1) / (v.sqrt() / bc2.sqrt()).add(eps)
        u = u.add(p, alpha=wd)
        u = u * (-torch.tensor(lr, dtype=torch.float32))
        p = p + u
        assert torch.equal(params["w"], p)
        assert torch.equal(state["adam"].mu["w"], m) and torch.equal(state["adam"].nu["w"], v)


@pytest.mark.parametrize("kw", [{"momentum": 0.0}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True},
                                {"momentum": 0.9, "dampening": 0.3}, {"momentum": 0.5, "weight_decay": 0.05},
                                {"momentum": 0.9, "nesterov": True, "weight_decay": 0.05}, {"weight_decay": 0.05}],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sgd_matches_torch_sgd(kw):
    params, grads = make_params(), make_grads()
    ours, _ = run_ours(sgd(lr=0.01, **kw), params, grads)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, lr=0.01, **kw), params, grads)
    assert_moved(params, ref)
    assert max_rel_diff(ours, ref) <= 1e-6


@pytest.mark.parametrize("kw", [{}, {"lr_decay": 0.1}, {"initial_accumulator_value": 0.1},
                                {"weight_decay": 0.05}, {"eps": 1e-3},
                                {"lr_decay": 0.05, "initial_accumulator_value": 0.2, "weight_decay": 0.01}],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
def test_adagrad_matches_torch_adagrad(kw):
    params, grads = make_params(), make_grads()
    ours, _ = run_ours(adagrad(lr=0.05, **kw), params, grads)
    ref = run_torch(lambda ps: torch.optim.Adagrad(ps, lr=0.05, **kw), params, grads)
    assert_moved(params, ref)
    assert max_rel_diff(ours, ref) <= 1e-6


def warmup_lr_formula(t: int, lo: float, hi: float, n: int) -> float:
    """DeepSpeed WarmupLR (log), written out: lr used by the step after the scheduler reached t."""
    if t < 0:
        return lo
    gamma = math.log(t + 1) / math.log(n) if t < n else 1.0
    return lo + (hi - lo) * gamma


def test_scheduled_lr_equals_torch_with_lr_set_per_step():
    params, grads = make_params(), make_grads()
    sched = warmup_lr(warmup_min_lr=1e-3, warmup_max_lr=2e-2, warmup_num_steps=8)
    ours, state = run_ours(adamw(lr=sched, weight_decay=0.1), params, grads)

    def set_lr(opt, k):  # the k-th applied step uses schedule(k - 1)
        opt.param_groups[0]["lr"] = warmup_lr_formula(k - 1, 1e-3, 2e-2, 8)

    ref = run_torch(lambda ps: torch.optim.AdamW(ps, lr=123.0, weight_decay=0.1), params, grads, set_lr)
    assert_moved(params, ref)
    assert max_rel_diff(ours, ref) <= 1e-6
    assert current_lr(state).item() == pytest.approx(warmup_lr_formula(STEPS - 1, 1e-3, 2e-2, 8), rel=1e-6)
    assert state["lr"].count.item() == STEPS


def test_lr_state_before_and_after_steps():
    sched = warmup_lr(warmup_min_lr=0.5, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    tx = sgd(lr=sched)
    params = make_params()
    state = tx.init(params)
    assert current_lr(state).item() == 0.5  # what DeepSpeed writes at construction (t = -1)
    used = []
    for g in make_grads()[:6]:
        _, state = tx.update(g, state, params)
        used.append(current_lr(state).item())
    assert used == pytest.approx([0.5, 0.5, 0.625, 0.75, 0.875, 1.0], rel=1e-7)
    const = sgd(lr=0.25)
    assert current_lr(const.init(params)).dtype == torch.float32
    assert current_lr(const.update(make_grads()[0], const.init(params), params)[1]).item() == 0.25
    assert current_lr(chain(clip_by_global_norm(1.0)).init(params)) is None


def test_momentum_schedule_equals_torch_with_betas_set_per_step():
    params, grads = make_params(), make_grads()
    mom = one_cycle_momentum(cycle_first_step_size=5, cycle_min_mom=0.8, cycle_max_mom=0.95)
    tx = optimizer_from_config("adam", {"lr": 1e-2, "weight_decay": 0.1}, None, momentum_schedule=mom)
    ours, _ = run_ours(tx, params, grads)

    def set_betas(opt, k):
        opt.param_groups[0]["betas"] = (mom(torch.tensor(k - 1)).item(), 0.99)

    ref = run_torch(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), params, grads, set_betas)
    assert_moved(params, ref)
    assert max_rel_diff(ours, ref) <= 1e-6


# ------------------------------------------------------------------------------------------------------------ LAMB

def f32_bias_correction(beta: float, t: int) -> float:
    """1 - beta**t as dsfunc (and torch's capturable Adam) computes it: float32 on device. For beta2 = 0.999 this is
    1.3e-5 relative below the float64 value (0.999 rounds up in float32), which shows on a parameter that starts at
    0, whose value is its first update."""
    return (1 - torch.tensor(beta, dtype=torch.float32) ** torch.tensor(float(t))).item()


def lamb_reference(params, grads, lr, b1, b2, eps, wd, min_coeff, max_coeff):
    """You et al. 2019, Algorithm 2, per parameter in float64, with DeepSpeed's clamp of the trust ratio."""
    out = {}
    for name, p in params.items():
        p = p.double()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        for t, g in enumerate(grads, start=1):
            g = g[name].double()
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / f32_bias_correction(b1, t), v / f32_bias_correction(b2, t)
            r = m_hat / (v_hat.sqrt() + eps) + wd * p
            pn, rn = p.norm().item(), r.norm().item()
            ratio = min(max(pn / rn, min_coeff), max_coeff) if pn > 0 and rn > 0 else 1.0
            p = p - lr * ratio * r
        out[name] = p.float()
    return out


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.01}, {"min_coeff": 0.5, "max_coeff": 0.6},
                                {"max_coeff": 0.02}], ids=["plain", "wd", "clamped", "max_clamped"])
def test_lamb_matches_the_published_rule(kw):
    params, grads = make_params(), make_grads()
    params = {"w": params["w"], "b": params["b"], "zero": torch.zeros(4)}
    grads = [{"w": g["w"], "b": g["b"], "zero": g["w"][0, :4]} for g in grads]
    args = {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-6, "wd": 0.0, "min_coeff": 0.01, "max_coeff": 10.0}
    args.update({"wd" if k == "weight_decay" else k: v for k, v in kw.items()})
    ours, _ = run_ours(lamb(lr=1e-2, eps=1e-6, **kw), params, grads)
    ref = lamb_reference(params, grads, **args)
    assert_moved({"w": params["w"]}, {"w": ref["w"]}, at_least=1e-4)
    assert max_rel_diff(ours, ref) <= 1e-6


def test_lamb_segment_norm_treats_a_flat_buffer_as_several_parameters():
    params, grads = make_params(), make_grads()
    sizes = [params["w"].numel(), params["b"].numel()]
    flat = {"unit": torch.cat([params["w"].flatten(), params["b"]])}
    flat_grads = [{"unit": torch.cat([g["w"].flatten(), g["b"]])} for g in grads]

    def segment_norm(tree):
        def per_element(sq):
            return torch.cat([s.sum().sqrt().expand(s.numel()) for s in sq.split(sizes)])
        return optree.tree_map(per_element, tree)

    tx = lamb(lr=1e-2, weight_decay=0.01)
    state = tx.init(flat)
    for g in flat_grads:
        updates, state = tx.update(g, state, flat, segment_norm=segment_norm)
        flat = apply_updates(flat, updates)
    split, _ = run_ours(lamb(lr=1e-2, weight_decay=0.01), {"w": params["w"], "b": params["b"]},
                        [{"w": g["w"], "b": g["b"]} for g in grads])
    w, b = flat["unit"].split(sizes)
    assert torch.allclose(w.view_as(split["w"]), split["w"], rtol=1e-6, atol=0)
    assert torch.allclose(b, split["b"], rtol=1e-6, atol=0)
    whole, _ = run_ours(lamb(lr=1e-2, weight_decay=0.01),
                        {"unit": torch.cat([params["w"].flatten(), params["b"]])}, flat_grads)
    assert not torch.allclose(whole["unit"], flat["unit"], rtol=1e-6, atol=0)  # the segments really mattered


# ------------------------------------------------------------------------------------------ clipping and scaling

def test_clip_by_global_norm_by_hand():
    u = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}  # norm 5
    tx = clip_by_global_norm(2.0)
    out, state = tx.update(u, tx.init(u))
    coef = (5.0 + 1e-6) / 2.0
    assert state == EmptyState()
    assert torch.equal(out["a"], torch.tensor([3.0, 0.0]) * torch.tensor(1 / coef))
    assert torch.allclose(out["b"], torch.tensor([[4.0 / coef]]), rtol=1e-7, atol=0)
    out, _ = tx.update(u, EmptyState(), global_norm=torch.tensor(10.0))  # the step's cross-rank norm wins
    assert torch.allclose(out["a"], torch.tensor([3.0 * 2.0 / (10.0 + 1e-6), 0.0]), rtol=1e-7, atol=0)
    out, _ = clip_by_global_norm(6.0).update(u, EmptyState())
    assert torch.equal(out["a"], u["a"]) and torch.equal(out["b"], u["b"])  # under the limit: unchanged
    out, _ = clip_by_global_norm(0.0).update(u, EmptyState())
    assert out is u


def test_scale_by_factor_by_hand():
    u = {"a": torch.tensor([2.0, -4.0])}
    tx = scale_by_factor()
    out, _ = tx.update(u, tx.init(u), grad_scale=torch.tensor(0.25))
    assert torch.equal(out["a"], torch.tensor([0.5, -1.0]))
    out, _ = tx.update(u, tx.init(u))
    assert out is u
    out, _ = scale_by_factor("inv").update(u, EmptyState(), inv=torch.tensor(2.0), grad_scale=torch.tensor(9.0))
    assert torch.equal(out["a"], torch.tensor([4.0, -8.0]))


def test_unscale_and_clip_in_one_factor_matches_deepspeed():
    """The step passes 1/(clip*loss_scale): DeepSpeed's unscale_and_clip_grads."""
    scale, max_norm = 1024.0, 1.0
    grads = {"a": torch.tensor([3.0, 4.0]) * scale}
    scaled_norm = 5.0 * scale
    clip = max(1.0, (scaled_norm / scale + 1e-6) / max_norm)
    out, _ = scale_by_factor().update(grads, EmptyState(), grad_scale=torch.tensor(1 / (clip * scale)))
    assert torch.allclose(out["a"], torch.tensor([0.6, 0.8]), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------- structure

def test_chain_and_named_chain_state_structure():
    params = make_params()
    tx = chain(scale_by_factor(), clip_by_global_norm(1.0), adam(lr=1e-3))
    state = tx.init(params)
    assert isinstance(state, tuple) and len(state) == 3
    assert state[0] == EmptyState() and state[1] == EmptyState()
    assert list(state[2]) == ["adam", "weight_decay", "lr"]
    assert isinstance(state[2]["adam"], ScaleByAdamState) and isinstance(state[2]["lr"], ScheduleState)
    assert state[2]["adam"].count.dtype == torch.int64 and state[2]["adam"].count.shape == ()
    assert optree.tree_structure(state[2]["adam"].mu) == optree.tree_structure(params)

    named = named_chain(("scale", scale_by_factor()), ("opt", adam(lr=1e-3, adam_w_mode=False)))
    nstate = named.init(params)
    assert list(nstate) == ["scale", "opt"] and list(nstate["opt"]) == ["weight_decay", "adam", "lr"]

    doubled = optree.tree_map(lambda x: x * 2, nstate)  # states are plain pytrees
    assert type(doubled["opt"]["adam"]) is ScaleByAdamState
    g = make_grads()[0]
    _, new = named.update(g, nstate, params, grad_scale=torch.tensor(0.5), unknown_extra=object())
    assert optree.tree_structure(new) == optree.tree_structure(nstate)
    assert new["opt"]["adam"].count.item() == 1 and nstate["opt"]["adam"].count.item() == 0

    with pytest.raises(ValueError, match="state of 2 entries"):
        tx.update(g, state[:2], params)
    with pytest.raises(ValueError, match="state with keys"):
        named.update(g, {"opt": nstate["opt"]}, params)
    with pytest.raises(ValueError, match="duplicate names"):
        named_chain(("a", sgd()), ("a", sgd()))
    with pytest.raises(ValueError, match=r"\(name, Transform\) pairs"):
        named_chain(sgd())


def test_updates_are_pure():
    params, grads = make_params(), make_grads()[:2]
    for tx in (adam(lr=0.1, weight_decay=0.1), lamb(), sgd(lr=0.1, momentum=0.9), adagrad(lr_decay=0.1)):
        state = tx.init(params)
        _, state = tx.update(grads[0], state, params)
        snapshot = optree.tree_map(torch.clone, (grads[1], state, params))
        updates, _new_state = tx.update(grads[1], state, params)
        new_params = apply_updates(params, updates)
        assert optree.tree_all(optree.tree_map(torch.equal, (grads[1], state, params), snapshot))
        assert not torch.equal(new_params["w"], params["w"])


def test_apply_updates_casts_to_param_dtype():
    params = {"h": torch.ones(3, dtype=torch.bfloat16), "f": torch.ones(2)}
    updates = {"h": torch.full((3,), 0.5), "f": torch.full((2,), 0.25, dtype=torch.float64)}
    out = apply_updates(params, updates)
    assert out["h"].dtype == torch.bfloat16 and out["f"].dtype == torch.float32
    assert out["h"].tolist() == [1.5] * 3 and out["f"].tolist() == [1.25] * 2


def test_missing_params_is_a_clear_error():
    p = make_params()
    tx = adamw(weight_decay=0.1)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(make_grads()[0], tx.init(p))


def test_no_host_sync_meta_tensors():
    """Meta tensors have no values: any .item(), bool() or Python branch on a tensor would raise."""
    params = optree.tree_map(lambda x: x.to("meta"), make_params())
    grads = optree.tree_map(lambda x: x.to("meta"), make_grads()[0])
    extra = {"grad_scale": torch.ones((), device="meta")}
    sched = warmup_lr(0.0, 0.1, 10)
    for tx in (adam(lr=sched), adam(adam_w_mode=False, weight_decay=0.1), lamb(weight_decay=0.1),
               sgd(momentum=0.9, nesterov=True), adagrad(lr_decay=0.1, weight_decay=0.1),
               chain(scale_by_factor(), clip_by_global_norm(1.0), adam(betas=(one_cycle_momentum(), 0.99)))):
        state = tx.init(params)
        updates, state = tx.update(grads, state, params, **extra)
        out = apply_updates(params, updates)
        assert all(x.device.type == "meta" for x in optree.tree_leaves((out, state)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_updates_never_sync_and_match_cpu():
    params, grads = make_params(), make_grads()[:5]

    def cuda(tree):
        return optree.tree_map(lambda x: x.cuda(), tree)

    sched = warmup_lr(0.0, 0.1, 3)
    makers = [lambda: adam(lr=sched, weight_decay=0.1), lambda: lamb(weight_decay=0.1),
              lambda: sgd(lr=sched, momentum=0.9, nesterov=True), lambda: adagrad(lr_decay=0.1),
              lambda: chain(scale_by_factor(), clip_by_global_norm(1.0),
                            adam(betas=(one_cycle_momentum(cycle_first_step_size=2), 0.99)))]
    for make in makers:
        want, _ = run_ours(make(), params, grads, grad_scale=torch.tensor(0.5))
        tx, gparams, ggrads, scale = make(), cuda(params), [cuda(g) for g in grads], torch.tensor(0.5).cuda()
        state = tx.init(gparams)
        with no_host_sync():  # any device->host read raises
            for g in ggrads:
                updates, state = tx.update(g, state, gparams, grad_scale=scale)
                gparams = apply_updates(gparams, updates)
        assert all(x.is_cuda for x in optree.tree_leaves(state))
        assert max_rel_diff(optree.tree_map(lambda x: x.cpu(), gparams), want) <= 1e-6


# ------------------------------------------------------------------------------------------------- from config

def test_optimizer_from_config_builds_the_named_optimizers():
    params, grads = make_params(), make_grads()[:5]
    cases = [
        ("adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False, "torch_adam": True},
         adam(lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
        ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, adamw(lr=1e-2, weight_decay=0.1)),
        ("adamw", {"lr": 1e-2, "weight_decay": 0.1}, adamw(lr=1e-2, weight_decay=0.1)),
        ("lamb", {"lr": 1e-2, "max_coeff": 0.5, "min_coeff": 0.1}, lamb(lr=1e-2, max_coeff=0.5, min_coeff=0.1)),
        ("sgd", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, sgd(lr=1e-2, momentum=0.9, nesterov=True)),
        ("adagrad", {"lr": 1e-2, "lr_decay": 0.1}, adagrad(lr=1e-2, lr_decay=0.1)),
    ]
    for kind, cfg, direct in cases:
        got, _ = run_ours(optimizer_from_config(kind, cfg, None), params, grads)
        want, _ = run_ours(direct, params, grads)
        assert optree.tree_all(optree.tree_map(torch.equal, got, want)), kind
    sched = warmup_lr(0.0, 0.1, 10)
    _, state = run_ours(optimizer_from_config("sgd", {"lr": 5.0}, sched), params, grads)
    assert current_lr(state).item() == pytest.approx(warmup_lr_formula(3, 0.0, 0.1, 10), rel=1e-6)


def test_optimizer_from_config_errors_name_the_problem():
    # a raw section is validated by the config's one table of DeepSpeed keys
    with pytest.raises(ConfigError, match=r'adam_w_mode = false contradicts optimizer.type "AdamW"'):
        optimizer_from_config("adamw", {"adam_w_mode": False}, None)
    with pytest.raises(ConfigError, match=r'optimizer.type = "rmsprop": .*not supported.*Adagrad'):
        optimizer_from_config("rmsprop", {}, None)
    with pytest.raises(ConfigError, match=r'"optimizer.params.momentum".*lr, betas'):
        optimizer_from_config("adam", {"momentum": 0.9}, None)
    with pytest.raises(ConfigError, match=r"optimizer.params.betas = \[0.9, 1.0\] is invalid: .*< 1"):
        optimizer_from_config("adam", {"betas": [0.9, 1.0]}, None)
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\)"):
        adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="nesterov momentum requires momentum > 0"):
        sgd(nesterov=True)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        adamw(weight_decay=-1.0)

