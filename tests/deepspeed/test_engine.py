"""The engine facade: same parameters as the functional API, DeepSpeed's accessors, misuse errors."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc.deepspeed import add_config_arguments, initialize
from dsfunc.zero.runtime import Phase
from tests.models import MLP, ConvBN, config, mlp_batches, relative_diff
from tests.multiprocess import run_world


def engine_run(engine, batches, gas: int) -> list[float]:
    """DeepSpeed's loop over this rank's micro-batches; returns the loss of each step."""
    losses = []
    for x, y in batches:
        micro = x.shape[0] // gas
        for i in range(gas):
            loss = engine(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro])
            engine.backward(loss)
            engine.step()
        losses.append(engine.state.metrics.loss.item())
    return losses


@pytest.mark.parametrize("gas, precision", [(1, None), (3, None), (2, "bf16"), (2, "fp16")])
def test_engine_equals_functional_api_bitwise(gas, precision):
    batches = mlp_batches(6, 2 * gas)
    cfg = config(micro=2, gas=gas, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}})
    if precision:
        cfg[precision] = {"enabled": True}
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(dropout=0.3), cfg, seed=3)
    losses = []
    for batch in batches:
        state = dsfunc.train_step(state, batch)
        losses.append(state.metrics.loss.item())
    torch.manual_seed(0)
    engine, _, _, _ = initialize(model=MLP(dropout=0.3), config=cfg, seed=3)
    assert engine_run(engine, batches, gas) == losses
    assert relative_diff(dsfunc.full_params(engine.state), dsfunc.full_params(state)) == 0.0
    assert engine.global_steps == 6 and engine.micro_steps == 6 * gas and engine.global_samples == 6 * 2 * gas


def test_batchnorm_buffers_follow_the_engine():
    torch.manual_seed(0)
    model = ConvBN()
    x, y = torch.randn(4, 3, 5, 5) * 3 + 1, torch.randint(0, 3, (4,))
    state = dsfunc.train_step(dsfunc.init_state(copy.deepcopy(model), config(micro=4)), (x, y))
    engine, *_ = initialize(model=model, config=config(micro=4))
    engine.backward(engine(x, y))
    engine.step()
    torch.testing.assert_close(engine.state.buffers["bn.running_mean"], state.buffers["bn.running_mean"],
                               rtol=0, atol=0)
    assert relative_diff(dsfunc.full_params(engine.state), dsfunc.full_params(state)) == 0.0


def ranks_engine_vs_functional(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 3):
        for gas in (1, 2):
            out[stage, gas] = engine_vs_functional(rank, world, stage, gas)
    return out


def engine_vs_functional(rank: int, world: int, stage: int, gas: int) -> dict:
    micro = 2
    cfg = config(micro=micro, gas=gas, world=world, stage=stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every block gathered lazily
    n = micro * gas
    batches = [(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]) for x, y in mlp_batches(5, n * world)]
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(width=10, depth=3), cfg)
    for batch in batches:
        state = dsfunc.train_step(state, batch)
    torch.manual_seed(0)
    engine, *_ = initialize(model=MLP(width=10, depth=3), config=cfg)
    engine_run(engine, batches, gas)
    x = batches[0][0]
    with torch.no_grad():
        evaluated = engine(x)
    live_after_eval = set(engine.state.program.run.workspace.stats.live_units)
    module = engine.module  # a collective at stage >= 1: every rank reads it
    return {
        "functional": dsfunc.full_params(state), "engine": dsfunc.full_params(engine.state),
        "evaluated": evaluated, "expected": module(x), "live_after_eval": live_after_eval,
        "world": engine.world_size, "rank": engine.global_rank,
    }


def test_engine_equals_functional_on_two_ranks_at_zero_stages_0_and_3():
    results = run_world(ranks_engine_vs_functional, 2)
    for (stage, gas), first in results[0].items():
        for rank, per_case in enumerate(results):
            r = per_case[stage, gas]
            assert relative_diff(r["engine"], r["functional"]) == 0.0, (stage, gas, rank)
            torch.testing.assert_close(r["evaluated"], r["expected"], rtol=1e-6, atol=1e-6)
            assert r["live_after_eval"] == set()
            assert (r["world"], r["rank"]) == (2, rank)
            assert relative_diff(r["engine"], first["engine"]) == 0.0


def test_accessors_and_boundaries():
    engine, optimizer, loader, scheduler = initialize(model=MLP(), config=config(micro=2, gas=3))
    assert loader is None and scheduler is None
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (6, 2, 3)
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert engine.device == torch.device("cpu")
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    x, y = mlp_batches(1, 2)[0]
    boundaries = []
    for _ in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y))
        engine.step()
    assert boundaries == [False, False, True] * 2
    assert engine.global_steps == 2 and engine.global_samples == 12 and engine.skipped_steps == 0
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    assert engine.get_lr() == [1e-3] and optimizer.param_groups[0]["lr"] == 1e-3
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    optimizer.zero_grad()
    engine.zero_grad()
    with pytest.raises(RuntimeError, match="call engine.step"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="engine.save_checkpoint"):
        optimizer.state_dict()


def test_get_lr_follows_the_config_schedule_like_deepspeed():
    cfg = config(micro=2, scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                     "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, optimizer, _, scheduler = initialize(model=MLP(), config=cfg)
    # DeepSpeed's WarmupLR: the k-th step uses lr(t = k - 1); t = -1 gives warmup_min_lr
    expected = [0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01]
    # DeepSpeed's get_last_lr: the lr the scheduler last wrote, i.e. the next step's (set at construction)
    assert scheduler.get_last_lr() == [pytest.approx(expected[0])]
    seen, used = [], []
    x, y = mlp_batches(1, 2)[0]
    for k in range(6):
        seen.append(engine.get_lr()[0])
        engine.backward(engine(x, y))
        engine.step()
        used.append(engine.state.metrics.lr.item())
        assert scheduler.get_last_lr() == [pytest.approx(expected[k + 1])]
    assert seen == pytest.approx(expected[:6])
    assert used == pytest.approx(expected[:6])
    assert scheduler.get_lr() == pytest.approx([expected[6]]) and scheduler.state_dict() == {"last_batch_iteration": 5}
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected[6])
    with pytest.raises(RuntimeError, match="remove lr_scheduler.step"):
        scheduler.step()


def test_misuse_gives_clear_errors():
    engine, *_ = initialize(model=MLP(), config=config(micro=2))
    x, y = mlp_batches(1, 2)[0]
    with pytest.raises(RuntimeError, match="backward\\(\\) without a training forward"):
        engine.backward(torch.tensor(1.0, requires_grad=True) * 2)
    with pytest.raises(RuntimeError, match="step\\(\\) before engine.backward"):
        engine.step()
    loss = engine(x, y)
    with pytest.raises(RuntimeError, match="step\\(\\) before engine.backward"):
        engine.step()
    with pytest.raises(ValueError, match=r"scalar floating-point tensor, got a tensor of shape \(2, 4\)"):
        engine.backward(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="the loss has no graph"):
        engine.backward(loss.detach())
    with torch.no_grad():
        assert not engine(x, y).requires_grad  # an evaluation, also while a training forward is open
    with pytest.raises(ValueError, match="lr_kwargs is not supported"):
        engine.step(lr_kwargs={"x": 1})
    assert engine.backward(loss) == loss  # DeepSpeed returns loss / gradient_accumulation_steps
    engine.step()
    engine.eval()
    assert not engine.module.training and engine(x, y).requires_grad  # as in DeepSpeed, the mode is the module's
    engine.train()
    engine.zero_grad()  # nothing to zero: that forward's graph stays usable
    assert engine.phase is Phase.FORWARD
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 2


def test_dist_init_required_false_needs_the_scripts_group():
    """As DeepSpeed's: False says the script initialised torch.distributed itself, so without a group it is an
    error; with one (a one-process group here) the engine trains in it."""
    with pytest.raises(RuntimeError, match="dist_init_required=False: torch.distributed is not initialized"):
        initialize(model=MLP(), config=config(micro=2), dist_init_required=False)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    engine, *_ = initialize(model=MLP(), config=config(micro=2), dist_init_required=False)
    x, y = mlp_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 1


def test_a_failed_forward_drops_the_step_and_the_engine_goes_on():
    engine, *_ = initialize(model=MLP(), config=config(micro=2, gas=2))
    x, y = mlp_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    with pytest.raises(RuntimeError):
        engine(torch.zeros(2, 5), y)  # wrong width
    assert engine.micro_steps == 0
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 1


def test_an_engine_without_optimizer_only_evaluates():
    cfg = config(micro=2)
    del cfg["optimizer"]
    engine, optimizer, _, scheduler = initialize(model=MLP(), config=cfg)
    assert optimizer is None and scheduler is None and engine.get_lr() == []
    x, y = mlp_batches(1, 2)[0]
    loss = engine(x, y)
    assert not loss.requires_grad
    with pytest.raises(RuntimeError, match='needs an optimizer: add an "optimizer" section'):
        engine.backward(loss)


def test_config_comes_from_exactly_one_place(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}')
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=-1)
    engine, *_ = initialize(args=args, model=MLP())
    assert engine.train_batch_size() == 4 and engine.get_lr() == [0.01] and args.local_rank == 0
    with pytest.raises(ValueError, match="both from args.deepspeed_config.*and from initialize\\(config=...\\)"):
        initialize(args=args, model=MLP(), config={"train_batch_size": 4})
    with pytest.raises(ValueError, match="no DeepSpeed config: pass --deepspeed_config"):
        initialize(args=argparse.Namespace(deepspeed_config=None), model=MLP())
    with pytest.raises(ValueError, match="no DeepSpeed config"):
        initialize(model=MLP())
    old = argparse.Namespace(deepscale_config=str(path), deepspeed_config=None)
    initialize(args=old, model=MLP())
    assert old.deepspeed_config == str(path)
    with pytest.raises(ValueError, match="both --deepscale_config and --deepspeed_config"):
        initialize(args=argparse.Namespace(deepscale_config=str(path), deepspeed_config=str(path)), model=MLP())
    engine, *_ = initialize(model=MLP(), config_params=str(path))
    assert engine.train_batch_size() == 4
    with pytest.raises(ValueError, match="needs the model"):
        initialize(config=str(path))
    with pytest.raises(AssertionError, match="passed as the first positional argument, which is args"):
        initialize(MLP(), config=str(path))  # DeepSpeed asserts, and its tests catch AssertionError
    with pytest.raises(ValueError, match="parallelism.*not supported"):
        initialize(model=MLP(), config=str(path), mpu=object())


def test_add_config_arguments(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "c.json", "--local_rank=3"])
    assert (args.deepspeed, args.deepspeed_config, args.local_rank) == (True, "c.json", 3)
    assert parser.parse_args(["--local-rank", "1"]).local_rank == 1
    assert parser.parse_args([]).local_rank == -1
    assert parser.parse_args(["--deepscale_config", "old.json"]).deepscale_config == "old.json"
    own = argparse.ArgumentParser()
    own.add_argument("--local_rank", type=int, default=7, help="mine")
    add_config_arguments(own)
    assert own.parse_args([]).local_rank == 7
    monkeypatch.setenv("LOCAL_RANK", "0")
    args.deepspeed_config = {"train_batch_size": 2}
    with pytest.raises(ValueError, match="Mismatch in local rank setting, args.local_rank=3 but env\\['LOCAL_RANK'\\]=0"):
        initialize(args=args, model=MLP())


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.head(torch.tanh(self.body(x))), y)


def test_model_parameters_choose_what_trains():
    torch.manual_seed(0)
    model = TwoHeads()
    before = copy.deepcopy(model.state_dict())
    chosen = filter(lambda p: p is not model.body.weight, model.parameters())  # a filter, as the tutorials
    engine, *_ = initialize(model=model, model_parameters=chosen, config=config(micro=2))
    assert not model.body.weight.requires_grad and model.body.bias.requires_grad
    x, y = mlp_batches(1, 2)[0]
    for _ in range(3):
        engine.backward(engine(x, y))
        engine.step()
    after = engine.module.state_dict()
    assert torch.equal(after["body.weight"], before["body.weight"])
    assert not torch.equal(after["body.bias"], before["body.bias"])
    # the same run through the functional API with the parameter frozen by hand
    torch.manual_seed(0)
    reference = TwoHeads()
    reference.body.weight.requires_grad_(False)
    state = dsfunc.init_state(reference, config(micro=2))
    for _ in range(3):
        state = dsfunc.train_step(state, (x, y))
    assert relative_diff(after, dsfunc.full_params(state)) == 0.0


def test_model_parameters_refusals():
    model = TwoHeads()
    with pytest.raises(TypeError, match="named_parameters\\(\\) gives \\(name, tensor\\) pairs"):
        initialize(model=model, config=config(micro=2), model_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="not parameters of the model"):
        initialize(model=model, config=config(micro=2), model_parameters=[nn.Parameter(torch.zeros(3))])
    groups = [{"params": model.body.parameters()}, {"params": list(model.head.parameters())}]
    initialize(model=model, config=config(micro=2), model_parameters=groups)
    assert not model.unused.weight.requires_grad


def torch_run(model, optimizer_fn, scheduler_fn, batches):
    model = copy.deepcopy(model)
    opt = optimizer_fn(model.parameters())
    sched = scheduler_fn(opt) if scheduler_fn else None
    lrs = []
    for x, y in batches:
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        if sched:
            sched.step()
    return model.state_dict(), lrs


CLIENT_OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1),
    "adam_l2": lambda p: torch.optim.Adam(p, lr=3e-3, weight_decay=0.05),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, weight_decay=1e-3),
}


@pytest.mark.parametrize("name", sorted(CLIENT_OPTIMIZERS))
def test_client_torch_optimizers_are_honoured(name):
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(8, 4)
    expected, _ = torch_run(model, CLIENT_OPTIMIZERS[name], None, batches)
    trained = copy.deepcopy(model)
    client = CLIENT_OPTIMIZERS[name](trained.parameters())
    engine, optimizer, _, _ = initialize(model=trained, optimizer=client, config=config(micro=4))
    engine_run(engine, batches, 1)
    assert relative_diff(engine.module.state_dict(), expected) < 1e-5
    assert optimizer.param_groups[0]["lr"] == client.param_groups[0]["lr"]
    # a callable optimizer gets the parameters, as DeepSpeed does
    trained = copy.deepcopy(model)
    engine, *_ = initialize(model=trained, optimizer=CLIENT_OPTIMIZERS[name], config=config(micro=4))
    engine_run(engine, batches, 1)
    assert relative_diff(engine.module.state_dict(), expected) < 1e-5


SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + k)),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "multistep": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 5, 5], gamma=0.3),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=1e-4),
    "linear": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=4),
    "constant": lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_client_torch_schedulers_are_honoured(name):
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(9, 4)
    make_opt = CLIENT_OPTIMIZERS["adamw"]
    expected, lrs = torch_run(model, make_opt, SCHEDULERS[name], batches)
    trained = copy.deepcopy(model)
    client = make_opt(trained.parameters())
    engine, *_ = initialize(model=trained, optimizer=client, lr_scheduler=SCHEDULERS[name](client),
                            config=config(micro=4))
    seen = []
    for x, y in batches:
        seen.append(engine.get_lr()[0])
        engine.backward(engine(x, y))
        engine.step()
    assert seen == pytest.approx(lrs, rel=1e-6)
    assert relative_diff(engine.module.state_dict(), expected) < 1e-5
    # a callable scheduler is built on the engine's (stand-in) optimizer
    engine, *_ = initialize(model=copy.deepcopy(model), optimizer=make_opt, lr_scheduler=SCHEDULERS[name],
                            config=config(micro=4))
    assert engine.get_lr() == pytest.approx([lrs[0]])


def test_client_optimizer_and_scheduler_refusals():
    model = MLP()
    with pytest.raises(AssertionError, match="zero_allow_untested_optimizer"):  # DeepSpeed's rule under ZeRO
        initialize(model=model, optimizer=torch.optim.RMSprop(model.parameters()), config=config(micro=2, stage=1))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6), torch.tensor([0, 1])).backward()
    stepped.step()
    with pytest.raises(ValueError, match="has state.*resume with engine.load_checkpoint"):
        initialize(model=model, optimizer=stepped, config=config(micro=2))
    client = torch.optim.AdamW(model.parameters())
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(client)
    with pytest.raises(TypeError, match="ReduceLROnPlateau cannot be translated: it follows a validation metric"):
        initialize(model=model, optimizer=client, lr_scheduler=plateau, config=config(micro=2))
    other = torch.optim.AdamW(model.parameters())
    unrelated = torch.optim.lr_scheduler.StepLR(other, 1, gamma=0.1)  # kept, to no effect, as DeepSpeed does
    engine, _, _, returned = initialize(model=model, optimizer=client, lr_scheduler=unrelated, config=config(micro=2))
    assert returned is unrelated and engine.get_lr() == [client.defaults["lr"]]
    engine.backward(engine(torch.randn(2, 6), torch.tensor([0, 1])))
    engine.step()
    assert engine.get_lr() == [client.defaults["lr"]] and unrelated.get_last_lr() == [other.defaults["lr"] * 0.1]
    fresh = MLP()
    client = torch.optim.AdamW(fresh.parameters())
    sched = torch.optim.lr_scheduler.StepLR(client, 2)
    client.step()  # no gradients yet: the optimizer keeps no state, but the scheduler moves on
    sched.step()
    with pytest.raises(ValueError, match="already been stepped \\(last_epoch=1\\)"):
        initialize(model=fresh, optimizer=client, lr_scheduler=sched, config=config(micro=2))


def test_module_is_the_users_model_with_current_weights_even_from_meta():
    torch.manual_seed(0)
    real = MLP()
    with torch.device("meta"):
        meta = MLP()
    engine, *_ = initialize(model=meta, config=config(micro=2))
    x, y = mlp_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    module = engine.module
    assert module is meta and not any(p.is_meta for p in module.parameters())
    assert relative_diff(module.state_dict(), dsfunc.full_params(engine.state)) == 0.0
    engine.eval()
    assert not engine.module.training
    del real


def test_a_callable_scheduler_without_client_optimizer_uses_the_config_lr():
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(5, 4)
    _, lrs = torch_run(model, lambda p: torch.optim.AdamW(p, lr=1e-3), SCHEDULERS["step"], batches)
    engine, _, _, scheduler = initialize(model=model, lr_scheduler=SCHEDULERS["step"], config=config(micro=4))
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)  # the one the callable built, as DeepSpeed returns
    seen = []
    for x, y in batches:
        assert scheduler.get_last_lr() == pytest.approx(engine.get_lr(), rel=1e-6)
        seen.append(engine.get_lr()[0])
        engine.backward(engine(x, y))
        engine.step()
    assert seen == pytest.approx(lrs, rel=1e-6)


def test_a_bad_config_leaves_the_model_untouched():
    model = TwoHeads()
    with pytest.raises(dsfunc.ConfigError, match="train_batch_size"):
        initialize(model=model, model_parameters=model.head.parameters(),
                   config={"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2})
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("stage, kind", [(0, "EngineOptimizer"), (2, "DeepSpeedZeroOptimizer"),
                                         (3, "DeepSpeedZeroOptimizer_Stage3")])
def test_the_optimizer_is_deepspeeds_zero_class_and_views_the_state(stage, kind):
    from dsfunc.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from dsfunc.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    fp16 = {"enabled": True, "initial_scale_power": 5, "loss_scale_window": 2}
    engine, optimizer, *_ = initialize(model=MLP(), config=config(micro=2, stage=stage, fp16=fp16))
    assert type(optimizer).__name__ == kind
    assert isinstance(optimizer, DeepSpeedZeroOptimizer) == (stage == 2)
    assert isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) == (stage == 3)
    assert optimizer.dynamic_loss_scale and optimizer.cur_scale == 32.0 and optimizer.loss_scaler.scale_window == 2
    for x, y in mlp_batches(3, 2):
        engine.backward(engine(x, y))
        engine.step()
    assert optimizer.loss_scaler.cur_iter == 3 and optimizer.cur_scale == 64.0  # doubled in the 3rd (window 2)
    (flat,) = optimizer.fp32_partitions()  # one group; one rank: the whole of every unit (padding is zeros)
    full = dsfunc.full_params(engine.state)
    torch.testing.assert_close(flat.sum(), sum(p.sum() for p in full.values()))
    assert flat.numel() >= sum(p.numel() for p in full.values())
    moments = [m for unit in optimizer.state.values() for key, m in unit.items() if key.endswith("/mu")]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # views of the trained state, not fresh zeros
