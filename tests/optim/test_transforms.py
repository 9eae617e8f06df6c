"""Clipping, scaling and the structure of chains: hand computations and purity."""

from __future__ import annotations

import optree
import pytest
import torch

from dsfunc.optim import (
    EmptyState,
    ScaleByAdamState,
    ScheduleState,
    adagrad,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    lamb,
    named_chain,
    scale_by_factor,
    sgd,
)
from dsfunc.schedules import one_cycle_momentum, warmup_lr
from tests.cuda_sync import no_host_sync
from tests.optim.helpers import make_grads, make_params, max_rel_diff, run_ours

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


