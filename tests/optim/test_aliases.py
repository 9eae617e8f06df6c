"""The named optimizers against torch.optim and the published LAMB rule, step by step."""

from __future__ import annotations

import optree
import pytest
import torch

from dsfunc.optim import (
    adagrad,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    current_lr,
    lamb,
    optimizer_from_config,
    sgd,
)
from dsfunc.schedules import one_cycle_momentum, warmup_lr
from tests.optim.helpers import (
    STEPS,
    assert_moved,
    make_grads,
    make_params,
    max_rel_diff,
    run_ours,
    run_torch,
    warmup_lr_formula,
)

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
        t = (torch.tensor(k, dtype=torch.int64) + 1).to(torch.float64)  # bias corrections: float64, rounded once
        bc1, bc2_sqrt = (1 - b1**t).to(torch.float32), (1 - b2**t).sqrt().to(torch.float32)
        u = (m / bc1) / (v.sqrt() / bc2_sqrt).add(eps)
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
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
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


