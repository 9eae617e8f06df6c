"""The engine is an nn.Module whose module is the user's model, trained in place, as DeepSpeed's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc.deepspeed import initialize
from tests.models import CLIP, MLP, SGD, config, mlp_batches, relative_diff, torch_sgd
from tests.multiprocess import run_world


def test_the_engine_is_a_module_around_the_users_model():
    net = MLP()
    engine, *_ = initialize(model=net, config=config(micro=2))
    assert isinstance(engine, nn.Module) and engine.module is net
    assert [p for p in engine.parameters()] == [p for p in net.parameters()]
    assert next(n for n, _ in engine.named_parameters()) == "module.inp.weight"  # as DeepSpeed's
    assert dict(engine.named_modules())["module.blocks.0"] is net.blocks[0]
    assert list(engine.state_dict()) == [f"module.{k}" for k in net.state_dict()]
    assert engine.inp is net.inp and engine.blocks is net.blocks  # unknown attributes are the module's
    with pytest.raises(AttributeError, match="'Engine' object has no attribute 'nothing'"):
        engine.nothing  # noqa: B018
    engine.eval()
    assert not net.training and not net.blocks[0].training
    engine.train()
    assert net.training and engine.zero_optimization_stage() == 0 and not engine.zero_optimization()


def test_a_forward_through_the_module_itself_trains_like_one_through_the_engine():
    batches = mlp_batches(4, 4)
    torch.manual_seed(0)
    via_engine, *_ = initialize(model=MLP(), config=config(micro=2, gas=2))
    torch.manual_seed(0)
    net = MLP()
    direct, *_ = initialize(model=net, config=config(micro=2, gas=2))
    for x, y in batches:
        for part in (slice(0, 2), slice(2, 4)):
            via_engine.backward(via_engine(x[part], y[part]))
            via_engine.step()
            direct.backward(net(x[part], y[part]))  # the module, not the engine
            direct.step()
    assert relative_diff(dsfunc.full_params(direct.state), dsfunc.full_params(via_engine.state)) == 0.0
    assert relative_diff(net.state_dict(), dsfunc.full_params(direct.state)) == 0.0


def test_loss_backward_instead_of_engine_backward():
    batches = mlp_batches(4, 4)
    torch.manual_seed(0)
    reference, *_ = initialize(model=MLP(), config=config(micro=2, gas=2))
    torch.manual_seed(0)
    engine, *_ = initialize(model=MLP(), config=config(micro=2, gas=2))
    for x, y in batches:
        for part in (slice(0, 2), slice(2, 4)):
            reference.backward(reference(x[part], y[part]))
            reference.step()
            engine(x[part], y[part]).backward()
            engine.step()
    assert relative_diff(dsfunc.full_params(engine.state), dsfunc.full_params(reference.state)) < 1e-6
    assert torch.isnan(engine.state.metrics.loss)  # the engine never saw the loss


def own_backward_ranks(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    """The script's own ``loss.backward()`` on each rank's share of the global batch, two micro-batches a step."""
    torch.manual_seed(0)
    cfg = config(micro=2, gas=2, world=world, stage=stage, optimizer=SGD, gradient_clipping=CLIP)
    engine, *_ = initialize(model=MLP(), config=cfg)
    for x, y in mlp_batches(4, 4 * world):
        mine = slice(rank * 4, (rank + 1) * 4)
        for part in (slice(0, 2), slice(2, 4)):
            engine(x[mine][part], y[mine][part]).backward()
            engine.step()
    return dsfunc.full_params(engine.state)


@pytest.mark.parametrize("stage", [0, 2])
def test_loss_backward_on_two_ranks_gives_the_mean_gradient_of_the_global_batch(stage):
    """The runtime divides a script's own backward by ranks and micro-batches as engine.backward's seed does."""
    torch.manual_seed(0)
    want = torch_sgd(MLP(), mlp_batches(4, 8))
    for rank, got in enumerate(run_world(own_backward_ranks, 2, stage)):
        assert relative_diff(got, want) < 1e-5, (stage, rank)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def gan_step(engine_d, engine_g, net_d, net_g, real, noise, *, direct: bool):
    """DeepSpeed's GAN example: D backpropagates the real and the fake loss before its step, then G
    backpropagates through D's output. ``direct`` calls the modules themselves, as that example does
    (``netD(real)``, ``netG(noise)``, ``netD.zero_grad()``)."""
    d, g = (net_d, net_g) if direct else (engine_d, engine_g)
    ones, zeros = torch.ones(len(real)), torch.zeros(len(real))
    d.zero_grad()
    engine_d.backward(F.binary_cross_entropy_with_logits(d(real), ones))
    fake = g(noise)
    engine_d.backward(F.binary_cross_entropy_with_logits(d(fake.detach()), zeros))
    engine_d.step()
    g.zero_grad()
    engine_g.backward(F.binary_cross_entropy_with_logits(d(fake), ones))
    engine_g.step()


def torch_gan_step(opt_d, opt_g, net_d, net_g, real, noise):
    ones, zeros = torch.ones(len(real)), torch.zeros(len(real))
    opt_d.zero_grad()
    F.binary_cross_entropy_with_logits(net_d(real), ones).backward()
    fake = net_g(noise)
    F.binary_cross_entropy_with_logits(net_d(fake.detach()), zeros).backward()
    opt_d.step()
    opt_g.zero_grad()
    F.binary_cross_entropy_with_logits(net_d(fake), ones).backward()
    opt_g.step()


@pytest.mark.parametrize("direct", [False, True])
def test_a_two_engine_gan_matches_torch(direct, tmp_path):
    torch.manual_seed(0)
    net_d, net_g = Discriminator(), Generator()
    ref_d, ref_g = copy.deepcopy(net_d), copy.deepcopy(net_g)
    opt_d = torch.optim.AdamW(ref_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.AdamW(ref_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0}
    engine_d, *_ = initialize(model=net_d, config=cfg,
                              optimizer=torch.optim.AdamW(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999)))
    engine_g, *_ = initialize(model=net_g, config=cfg,
                              optimizer=torch.optim.AdamW(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999)))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        real, noise = torch.randn(4, 4, generator=g) + 1, torch.randn(4, 3, generator=g)
        gan_step(engine_d, engine_g, net_d, net_g, real, noise, direct=direct)
        torch_gan_step(opt_d, opt_g, ref_d, ref_g, real, noise)
    assert relative_diff(net_d.state_dict(), ref_d.state_dict()) < 1e-5
    assert relative_diff(net_g.state_dict(), ref_g.state_dict()) < 1e-5
    # D's forward for G's loss had no backward of D's own: it holds nothing, so D saves as after a step
    assert engine_d.save_checkpoint(tmp_path / "d") and engine_g.save_checkpoint(tmp_path / "g")


def module_matches_state(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(rank)  # unseeded alike: rank 0's weights win
        net = MLP(width=10, depth=3)
        cfg = config(micro=2, gas=2, world=world, stage=stage)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        engine, *_ = initialize(model=net, config=cfg)
        for x, y in mlp_batches(3, 4 * world):
            mine = slice(rank * 4, (rank + 1) * 4)
            for part in (slice(0, 2), slice(2, 4)):
                engine.backward(engine(x[mine][part], y[mine][part]))
                engine.step()
        x = mlp_batches(1, 2, seed=9)[0][0]
        with torch.no_grad():
            through_net = net(x)  # at stage 3 every rank must run it: the blocks are gathered for it
        shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        held = dict(net.state_dict()) if stage < 3 else None
        if rank == 0:  # reading the module is never a collective: rank 0 alone may do it
            only_rank0 = {k: v.clone() for k, v in engine.module.state_dict().items()}
        full = dsfunc.full_params(engine.state)
        reference = MLP(width=10, depth=3)
        reference.load_state_dict(full)
        out[stage] = {"full": full, "held": held, "shapes": shapes, "through_net": through_net,
                      "reference": reference(x).detach(), "rank0": only_rank0 if rank == 0 else None}
    return out


def test_the_module_holds_the_trained_weights_at_every_stage_on_two_ranks():
    results = run_world(module_matches_state, 2)
    for stage in (0, 1, 2, 3):
        for rank, r in enumerate(results):
            case = r[stage]
            assert relative_diff(case["full"], results[0][stage]["full"]) == 0.0, (stage, rank)
            torch.testing.assert_close(case["through_net"], case["reference"], rtol=1e-6, atol=1e-6)
            if stage < 3:
                assert relative_diff(case["held"], case["full"]) == 0.0, (stage, rank)
            else:  # the blocks' parameters are empty outside a forward, as DeepSpeed's
                assert case["shapes"]["blocks.0.0.weight"] == (0,) and case["shapes"]["inp.weight"] == (10, 6)
        if stage < 3:
            assert relative_diff(results[0][stage]["rank0"], results[0][stage]["full"]) == 0.0
