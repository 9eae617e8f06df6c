"""The functional core on one process: init_state / train_step against plain PyTorch."""

from __future__ import annotations

import copy
import dataclasses

import optree
import pytest
import torch

import dsfunc
from dsfunc.optim import FusedAdam
from tests.models import MLP, ConvBN, config, mlp_batches, relative_diff


def torch_reference(model: torch.nn.Module, batches, lr=1e-3, weight_decay=0.01) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for x, y in batches:
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return model.state_dict()


def test_matches_plain_pytorch_adamw():
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(10, 4)
    state = dsfunc.init_state(model, config())
    for batch in batches:
        state = dsfunc.train_step(state, batch)
    assert int(state.step) == 10
    assert relative_diff(dsfunc.full_params(state), torch_reference(model, batches)) < 1e-6


def test_accumulation_equals_one_big_micro_batch():
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(5, 8)
    a = dsfunc.init_state(model, config(micro=2, gas=4))
    b = dsfunc.init_state(model, config(micro=8, gas=1))
    for batch in batches:
        a = dsfunc.train_step(a, batch)
        b = dsfunc.train_step(b, batch)
    assert relative_diff(dsfunc.full_params(a), dsfunc.full_params(b)) < 1e-6
    # a list of micro-batches is the same step
    c = dsfunc.init_state(model, config(micro=2, gas=4))
    for x, y in batches:
        c = dsfunc.train_step(c, [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)])
    assert relative_diff(dsfunc.full_params(c), dsfunc.full_params(a)) == 0.0


def test_batchnorm_statistics_come_back_in_the_new_state():
    torch.manual_seed(0)
    model = ConvBN()
    state = dsfunc.init_state(model, config(micro=4))
    x, y = torch.randn(4, 3, 5, 5) * 3 + 1, torch.randint(0, 3, (4,))
    before = state.buffers["bn.running_mean"].clone()
    new = dsfunc.train_step(state, (x, y))
    reference = copy.deepcopy(model).train()
    reference(x, y)
    torch.testing.assert_close(new.buffers["bn.running_mean"].cpu(), reference.bn.running_mean)
    assert int(new.buffers["bn.num_batches_tracked"]) == 1
    assert not torch.equal(new.buffers["bn.running_mean"], before)
    model.load_state_dict(dsfunc.full_params(new))  # buffers included: a plain module accepts it


def test_dropout_is_reproducible_from_the_state():
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(dropout=0.5), config(), seed=7)
    batch = mlp_batches(1, 4)[0]
    a = dsfunc.train_step(state, batch, donate=False)
    b = dsfunc.train_step(state, batch, donate=False)
    assert a.metrics.loss.item() == b.metrics.loss.item()
    assert relative_diff(dsfunc.full_params(a), dsfunc.full_params(b)) == 0.0
    other = dsfunc.init_state(MLP(dropout=0.5), config(), seed=8)
    c = dsfunc.train_step(other, batch)
    assert c.metrics.loss.item() != a.metrics.loss.item()


def test_donation_and_donate_false():
    state = dsfunc.init_state(MLP(), config())
    batch = mlp_batches(1, 4)[0]
    kept = dsfunc.train_step(state, batch, donate=False)
    assert not state.donated and int(state.step) == 0 and int(kept.step) == 1
    new = dsfunc.train_step(state, batch)
    assert state.donated
    assert relative_diff(dsfunc.full_params(new), dsfunc.full_params(kept)) == 0.0
    with pytest.raises(dsfunc.DonatedStateError, match="Use the returned state"):
        dsfunc.train_step(state, batch)
    with pytest.raises(dsfunc.DonatedStateError, match="donate=False"):
        state.params  # noqa: B018
    with pytest.raises(dsfunc.DonatedStateError):
        dsfunc.full_params(state)


def test_state_is_immutable_and_a_pytree():
    state = dsfunc.init_state(MLP(), config())
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"state.replace\(params=...\)"):
        state.params = {}
    with pytest.raises(TypeError, match="state.replace"):
        state.params["root"] = torch.zeros(1)
    doubled = optree.tree_map(lambda t: t * 2 if t.is_floating_point() else t, state)
    assert isinstance(doubled, dsfunc.TrainState) and doubled.program is state.program
    torch.testing.assert_close(doubled.params["root"], state.params["root"] * 2)
    assert state.replace(step=torch.tensor(5)).step == 5


def test_batch_of_the_wrong_size_says_what_to_pass():
    state = dsfunc.init_state(MLP(), config(micro=2, gas=2))
    x, y = mlp_batches(1, 6)[0]
    with pytest.raises(ValueError, match=r"6 samples.*\(2\) x gradient_accumulation_steps \(2\) = 4"):
        dsfunc.train_step(state, (x, y))
    with pytest.raises(ValueError, match="same number of samples"):
        dsfunc.train_step(state, (x[:4], y[:3]))
    with pytest.raises(TypeError, match="holds no tensors"):
        dsfunc.train_step(state, "not a batch")
    with pytest.raises(TypeError, match=r"the batch holds no tensors \(got list of 64 int\)"):
        dsfunc.train_step(state, list(range(64)))
    with pytest.raises(TypeError, match=r"holds no tensors \(got str\)"):  # one micro-batch of two without any
        dsfunc.train_step(state, [(x[:2], y[:2]), "oops"])
    with pytest.raises(ValueError, match=r"tensors on the meta device, which have shapes but no data \(shapes "
                                         r"\[\(4, 6\), \(4,\)\]\); pass tensors with data"):
        dsfunc.train_step(state, (x[:4].to("meta"), y[:4].to("meta")))
    assert not state.donated  # a rejected batch consumes nothing


def test_loss_must_be_a_scalar():
    state = dsfunc.init_state(MLP(), config(), loss_fn=lambda model, batch: model(batch[0]))
    with pytest.raises(ValueError, match=r"scalar floating-point tensor, got a tensor of shape \(4, 4\)"):
        dsfunc.train_step(state, mlp_batches(1, 4)[0])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_lowers_the_loss(precision):
    torch.manual_seed(0)
    cfg = config(micro=16, **{precision: {"enabled": True}})
    cfg["optimizer"]["params"]["lr"] = 1e-2
    state = dsfunc.init_state(MLP(width=16), cfg)
    x, y = mlp_batches(1, 16)[0]
    first = None
    for _ in range(30):
        state = dsfunc.train_step(state, (x, y))
        first = first if first is not None else state.metrics.loss.item()
    assert state.metrics.loss.item() < 0.7 * first
    assert state.params["root"].dtype == torch.float32  # master weights stay fp32


def test_fp16_nan_batch_is_skipped_and_training_continues():
    torch.manual_seed(0)
    cfg = config(micro=4, fp16={"enabled": True, "hysteresis": 1, "initial_scale_power": 8})
    state = dsfunc.init_state(MLP(), cfg)
    good = mlp_batches(3, 4)
    state = dsfunc.train_step(state, good[0])
    before = dsfunc.full_params(state)
    opt_before = optree.tree_map(torch.clone, state.opt_state)
    x, y = good[1]
    state = dsfunc.train_step(state, (torch.full_like(x, float("nan")), y))
    assert int(state.metrics.skipped) == 1
    assert state.metrics.loss_scale.item() == 256.0 and state.scaler.scale.item() == 128.0
    assert relative_diff(dsfunc.full_params(state), before) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(opt_before), optree.tree_leaves(state.opt_state)))
    state = dsfunc.train_step(state, good[2])
    assert int(state.metrics.skipped) == 0 and int(state.step) == 3
    assert relative_diff(dsfunc.full_params(state), before) > 0


def test_full_params_load_into_the_plain_module_and_agree():
    torch.manual_seed(0)
    model = MLP()
    state = dsfunc.init_state(model, config())
    for batch in mlp_batches(3, 4):
        state = dsfunc.train_step(state, batch)
    fresh = MLP()
    fresh.load_state_dict(dsfunc.full_params(state))
    x, y = mlp_batches(1, 4, seed=5)[0]
    loss = dsfunc.train_step(state, (x, y), donate=False).metrics.loss
    torch.testing.assert_close(fresh(x, y), loss.cpu())


def test_make_train_step_composes_transforms_by_hand():
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(4, 8)
    state = dsfunc.init_state(model, config(micro=2, gas=4), optimizer=dsfunc.sgd(lr=0.1))
    grad_fn = dsfunc.shard()(dsfunc.accumulate(4)(dsfunc.value_and_grad(lambda m, b: m(*b))))
    step = dsfunc.make_train_step(grad_fn)
    for batch in batches:
        state = step(state, batch)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        reference(x, y).backward()
        opt.step()
    assert relative_diff(dsfunc.full_params(state), reference.state_dict()) < 1e-6


def test_meta_model_materialises_with_reset_parameters():
    with torch.device("meta"):
        model = MLP()
    state = dsfunc.init_state(model, config(), seed=3)
    again = dsfunc.init_state(model, config(), seed=3)
    full = dsfunc.full_params(state)
    assert relative_diff(full, dsfunc.full_params(again)) == 0.0
    assert all(not t.is_meta and t.abs().sum() > 0 for k, t in full.items() if k.endswith("weight"))
    state = dsfunc.train_step(state, mlp_batches(1, 4)[0])
    assert torch.isfinite(state.metrics.loss)


def test_metrics_are_device_tensors():
    state = dsfunc.init_state(MLP(), config())
    state = dsfunc.train_step(state, mlp_batches(1, 4)[0])
    m = state.metrics.to_dict()
    assert set(m) == {"loss", "grad_norm", "loss_scale", "lr", "skipped"}
    assert m["lr"] == pytest.approx(1e-3) and m["loss_scale"] == 1.0 and m["grad_norm"] > 0


def test_fused_update_path_agrees_with_the_transform_chain():
    """The config's AdamW runs as one fused op per unit; the same optimizer as a chain gives the same result."""
    torch.manual_seed(0)
    model = MLP()
    cfg = config(gradient_clipping=0.5, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}})
    fused = dsfunc.init_state(model, cfg)
    assert isinstance(fused.program.update, FusedAdam)
    # the chain carries the config's schedule already: the config beside it has none
    reference = dsfunc.init_state(model, {**cfg, "scheduler": None}, optimizer=fused.program.update.chain)
    assert not isinstance(reference.program.update, FusedAdam)
    for batch in mlp_batches(8, 4):
        fused = dsfunc.train_step(fused, batch)
        reference = dsfunc.train_step(reference, batch)
    assert relative_diff(dsfunc.full_params(fused), dsfunc.full_params(reference)) < 1e-6
    assert fused.metrics.lr.item() == reference.metrics.lr.item()
    a, b = optree.tree_leaves(fused.opt_state), optree.tree_leaves(reference.opt_state)
    assert all(torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-9) for x, y in zip(a, b))


def test_a_skipped_fp16_step_records_the_lr_of_the_step_before_it():
    """On overflow nothing advances, the schedule neither (DeepSpeed does not step its lr scheduler then): the
    skipped step's lr metric is the last applied step's, not the one it would have used, fused or chained."""
    warmup = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}
    cfg = config(fp16={"enabled": True, "initial_scale_power": 8}, scheduler={"type": "WarmupLR", "params": warmup})
    batches = mlp_batches(5, 4)
    x, y = batches[3]
    poisoned = batches[:3] + [(torch.full_like(x, float("inf")), y)] + batches[4:]

    def lrs(fused: bool, data: list) -> list[float]:
        torch.manual_seed(0)
        model = MLP()
        state = dsfunc.init_state(model, cfg)
        if not fused:
            state = dsfunc.init_state(model, {**cfg, "scheduler": None}, optimizer=state.program.update.chain)
        assert isinstance(state.program.update, FusedAdam) is fused
        out = []
        for batch in data:
            state = dsfunc.train_step(state, batch)
            out.append((state.metrics.lr.item(), int(state.metrics.skipped)))
        return out

    for fused in (True, False):
        clean = [lr for lr, _ in lrs(fused, batches)]
        assert clean[1] < clean[2] < clean[3]  # still warming up: a wrong step's lr shows
        want = [(lr, 0) for lr in clean[:3]] + [(clean[2], 1), (clean[3], 0)]
        assert lrs(fused, poisoned) == want, fused


def test_overflow_at_the_minimum_loss_scale_is_a_clear_error_unless_told_to_keep_skipping():
    torch.manual_seed(0)
    fp16 = {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1, "hysteresis": 1}
    x, y = mlp_batches(1, 4)[0]
    nan = (torch.full_like(x, float("nan")), y)
    state = dsfunc.init_state(MLP(), config(fp16=fp16))
    state = dsfunc.train_step(state, nan)  # overflows at scale 1 == min_loss_scale
    with pytest.raises(dsfunc.LossScaleError, match="bf16"):
        dsfunc.train_step(state, (x, y))
    keep = dsfunc.init_state(MLP(), config(fp16={**fp16, "raise_error_at_min_scale": False}))
    for _ in range(3):
        keep = dsfunc.train_step(keep, nan)
    assert int(keep.metrics.skipped) == 1 and keep.scaler.scale.item() == 1.0
    keep = dsfunc.train_step(keep, (x, y))
    assert int(keep.metrics.skipped) == 0


def test_every_dsfunc_error_class_derives_from_dsfunc_error():
    import inspect

    from tests.modules import dsfunc_modules

    errors = {
        obj
        for module in dsfunc_modules()
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__.startswith("dsfunc")
    }
    assert {dsfunc.ConfigError, dsfunc.CheckpointError, dsfunc.DonatedStateError, dsfunc.LossScaleError} <= errors
    assert [e.__qualname__ for e in errors if not issubclass(e, dsfunc.Error)] == []
    assert issubclass(dsfunc.DonatedStateError, RuntimeError) and issubclass(dsfunc.ConfigError, ValueError)


def test_a_transform_beside_a_config_scheduler_is_an_error():
    """The transform's learning rate is its own: a config schedule would silently not apply (issue 13)."""
    cfg = config(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
    with pytest.raises(ValueError, match=r'"scheduler" section \(WarmupLR\), which would not apply') as e:
        dsfunc.init_state(MLP(), cfg, optimizer=dsfunc.sgd(lr=0.1))
    assert "optimizer=dsfunc.adamw(lr=dsfunc.warmup_lr(" in str(e.value) and "set it to null" in str(e.value)
    schedule = dsfunc.warmup_lr(warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    state = dsfunc.init_state(MLP(), {**cfg, "scheduler": None}, optimizer=dsfunc.sgd(lr=schedule))
    for batch in mlp_batches(3, 4):
        state = dsfunc.train_step(state, batch)
    assert state.metrics.lr.item() == pytest.approx(0.01)  # the transform's schedule applies (step 3: lr(1))
