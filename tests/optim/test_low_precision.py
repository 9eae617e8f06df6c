"""bf16 master weights and optimizer states (``bf16.bf16_master_weights_and_grads``, ``bf16.bf16_optimizer_states``):
fp32 arithmetic, one rounding per stored value (to nearest, DeepSpeed's fused and CPU Adam's; or stochastic), at
ZeRO 1-3 on 1 and 2 gloo ranks against a one-process reference written here."""

from __future__ import annotations

import dataclasses
import functools
import math

import optree
import pytest
import torch

import dsfunc
from dsfunc.config import ConfigError
from dsfunc.optim import adamw, sgd
from dsfunc.optim.low_precision import ROUNDINGS, compensations, low_precision, round_stochastically
from tests.models import MLP, mlp_batches
from tests.multiprocess import run_world

STEPS, MICRO, CLIP = 6, 4, 0.5
OPTIMIZERS = {
    "AdamW": {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.1},
    "SGD": {"lr": 0.05, "momentum": 0.9},
}


def bf16_config(stage: int, optimizer: str, rounding: str = "nearest", *, states: bool = True,
                offload: bool | str = False, gas: int = 1) -> dict:
    """bf16 masters (and moments, if ``states``) at ZeRO ``stage``, ``gas`` micro-batches a step; ``offload``:
    the optimizer on the host (``"param"``: the parameters too)."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "param":
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]},
        "gradient_clipping": CLIP,
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": states,
            "rounding": rounding,
        },
        "zero_optimization": zero,
    }


def adamw_step(
    s: dict, g: torch.Tensor, w: torch.Tensor, t: int, b1: float, b2: float, eps: float, decay: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW's fp32 arithmetic from the stored (bf16) moments, as torch.optim.AdamW writes it."""
    m = s.get("m", torch.zeros_like(w)).float().mul(b1).add(g, alpha=1 - b1)
    v = s.get("v", torch.zeros_like(w)).float().mul(b2).addcmul(g, g, value=1 - b2)
    return m, v, ((m / (1 - b1**t)) / (v.sqrt() / math.sqrt(1 - b2**t)).add(eps)).add(w, alpha=decay)


def summed(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, gas: int,
           sums: dict[str, torch.Tensor], rounded: bool = True) -> None:
    """Add the gradients of ``gas`` micro-batches of ``MICRO`` rows (of loss / gas, in the model's bf16) to
    ``sums`` (fp32 tensors), rounding the sum to bf16 after each when ``gas > 1`` (DeepSpeed's bf16 gradients;
    unless not ``rounded``)."""
    for k in range(0, MICRO * gas, MICRO):
        model.zero_grad()
        (model(x[k : k + MICRO].bfloat16(), y[k : k + MICRO]) / gas).backward()
        for name, p in model.named_parameters():
            sums[name] = sums[name] + p.grad.float()
            if gas > 1 and rounded:
                sums[name] = sums[name].bfloat16().float()


def reference(world: int, optimizer: str, rounding: str = "nearest", states: bool = True,
              gas: int = 1) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: a bf16 copy of the model (the masters) computes each rank's gradient, their mean in fp32 is
    rounded to bf16 (DeepSpeed's bf16 gradients; with ``gas`` micro-batches on one rank, each micro-batch's
    gradient of loss / gas added to the bf16 sum and rounded to nearest) and clipped; then the optimizer in fp32
    from the stored moments (bf16 if ``states``, else fp32), every new bf16 value rounded to nearest; with
    ``rounding="kahan"`` each weight's target adds its compensation, which keeps the remainder."""
    assert world == 1 or gas == 1  # over ranks the stages sum micro-batches in different orders
    torch.manual_seed(0)
    model = MLP(width=10, depth=3).bfloat16()
    opts, state, norms = OPTIMIZERS[optimizer], {}, []
    stored = torch.bfloat16 if states else torch.float32
    rows = MICRO * gas
    for t, (x, y) in enumerate(mlp_batches(STEPS, rows * world), start=1):
        grads = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
        for r in range(world):
            summed(model, x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows], gas, grads)
        grads = {n: (g / world).bfloat16().float() for n, g in grads.items()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        norms.append(norm.item())
        coef = max(1.0, (norm.item() + 1e-6) / CLIP)
        with torch.no_grad():
            for name, p in model.named_parameters():
                g, s, w = grads[name] / coef, state.setdefault(name, {}), p.float()
                if optimizer == "AdamW":
                    m, v, step = adamw_step(s, g, w, t, *opts["betas"], opts["eps"], opts["weight_decay"])
                    s["m"], s["v"] = m.to(stored), v.to(stored)
                else:
                    m = step = g if t == 1 else s["m"].float().mul(opts["momentum"]).add(g)
                    s["m"] = m.to(stored)
                if rounding == "kahan":
                    target = w + (step * -opts["lr"] + s.get("c", torch.zeros_like(p)).float())
                    p.copy_(target.bfloat16())
                    s["c"] = (target - p.float()).bfloat16()
                else:
                    p.copy_((w + step * -opts["lr"]).bfloat16())
    return {k: v.float() for k, v in model.state_dict().items()}, norms


def train_ranks(rank: int, world: int, optimizer: str, stages: list[int], rounding: str = "nearest", *,
                states: bool = True, offload: bool | str = False, gas: int = 1) -> dict:
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        cfg = bf16_config(stage, optimizer, rounding, states=states, offload=offload, gas=gas)
        # on the CPU where the reference is (init_state's default device is the GPU where there is one)
        state = dsfunc.init_state(MLP(width=10, depth=3), cfg, device="cpu")
        norms = []
        for x, y in mlp_batches(STEPS, MICRO * gas * world):
            mine = slice(rank * MICRO * gas, (rank + 1) * MICRO * gas)
            state = dsfunc.train_step(state, (x[mine], y[mine]))
            norms.append(state.metrics.grad_norm.item())
        stored = [t.dtype for t in optree.tree_leaves(state.opt_state["optimizer"].inner) if t.dim() > 0]
        out[stage] = {
            "full": dsfunc.full_params(state),
            "norms": norms,
            "moments": stored,
            "offloaded": getattr(state.program.run.runner, "host", None) is not None,
            "on_host": {p.device.type for p in state.params.values()} == {"cpu"},
            "masters": [p.dtype for p in state.params.values()],
            "bytes": sum(
                t.numel() * t.element_size()
                for t in [
                    *state.params.values(),
                    *(t for t in optree.tree_leaves(state.opt_state) if t.dim() > 0),
                ]
            ),
        }
    return out


@pytest.mark.parametrize(("world", "gas"), [(1, 1), (2, 1), (1, 4)])
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_bf16_states_match_the_reference(world, gas, optimizer):
    """Every weight equal to the reference's, bit for bit, at every stage and world size, the gradients summed over
    micro-batches in bf16."""
    expected, norms = reference(world, optimizer, gas=gas)
    assert min(norms) > CLIP  # the clip is active: a wrong clip factor shows
    for rank, result in enumerate(run_world(functools.partial(train_ranks, gas=gas), world, optimizer, [1, 2, 3], timeout=600)):
        for stage, got in result.items():
            assert set(got["moments"]) == {torch.bfloat16} and set(got["masters"]) == {torch.bfloat16}
            assert max(abs(a - b) / b for a, b in zip(got["norms"], norms)) < 1e-2
            for name, value in expected.items():
                assert torch.equal(got["full"][name], value), (world, rank, stage, name)


def test_bf16_states_halve_the_sharded_bytes():
    """2 bytes a master and 2 a moment (AdamW: 6 bytes a parameter, sharded) where fp32 keeps 12."""
    got = run_world(train_ranks, 1, "AdamW", [1], timeout=300)[0][1]
    numel = sum(p.numel() for p in MLP(width=10, depth=3).parameters())
    assert got["bytes"] == 6 * numel


def test_low_precision_is_one_rounding_of_fp32_arithmetic():
    """Per parameter, without ZeRO: bit for bit the reference's AdamW and SGD with momentum."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 7, generator=g).bfloat16(), "b": torch.randn(7, generator=g).bfloat16()}
    for inner, opt in (
        (adamw(lr=0.02, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1), "AdamW"),
        (sgd(lr=0.05, momentum=0.9), "SGD"),
    ):
        tx, p, ref, s = low_precision(inner), dict(params), {k: v.clone() for k, v in params.items()}, {}
        state = tx.init(p)
        for t in range(1, 6):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in p.items()}
            updates, state = tx.update(grads, state, p)
            p = {k: (p[k] + updates[k]).to(torch.bfloat16) for k in p}
            for k, gk in grads.items():
                w, st = ref[k].float(), s.setdefault(k, {})
                if opt == "AdamW":
                    m, v, step = adamw_step(st, gk, w, t, 0.9, 0.99, 1e-6, 0.1)
                    st["m"], st["v"] = m.bfloat16(), v.bfloat16()
                else:
                    m = step = gk if t == 1 else st["m"].float().mul(0.9).add(gk)
                    st["m"] = m.bfloat16()
                ref[k] = (w + step * -(0.05 if opt == "SGD" else 0.02)).bfloat16()
            assert all(torch.equal(p[k], ref[k]) for k in p), (opt, t)
        assert {t.dtype for t in optree.tree_leaves(state.inner) if t.dim() > 0} == {torch.bfloat16}


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.full((100_000,), 1.0 + 2**-10)  # an eighth of a bf16 ulp above 1
    r = round_stochastically(x, torch.tensor(3), salt=0).float()
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert abs(r.mean().item() - x[0].item()) < 4 * 2**-7 * (0.125 * 0.875 / len(x)) ** 0.5  # 4 sigma
    assert not torch.equal(
        r, round_stochastically(x, torch.tensor(4), salt=0).float()
    )  # another step: new bits
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -1.0])
    out = round_stochastically(special, torch.tensor(0), salt=0)
    assert out[0].isnan() and out[1:].float().tolist() == [float("inf"), -float("inf"), 0.0, -1.0]


def test_stochastic_rounding_keeps_updates_below_an_ulp():
    """lr * grad far below half a bf16 ulp: to nearest the weights never move; stochastically they move by the
    updates' sum on average."""
    cfgs = {r: bf16_config(1, "SGD", r) for r in ("nearest", "stochastic")}
    for cfg in cfgs.values():
        cfg["optimizer"]["params"] = {"lr": 1e-4}
        cfg["gradient_clipping"] = 0.0
    finals = {}
    for rounding, cfg in cfgs.items():
        torch.manual_seed(0)
        state = dsfunc.init_state(MLP(width=64, depth=1), cfg)
        start = dsfunc.full_params(state)
        for x, y in mlp_batches(4, MICRO):
            state = dsfunc.train_step(state, (x, y))
        finals[rounding] = {
            k: (v - start[k]).abs().sum().item() for k, v in dsfunc.full_params(state).items()
        }
    assert finals["stochastic"]["blocks.0.0.weight"] > 0
    assert finals["nearest"]["blocks.0.0.weight"] < finals["stochastic"]["blocks.0.0.weight"]


BOTH = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


@pytest.mark.parametrize(
    ("bf16", "zero", "match"),
    [
        ({"bf16_optimizer_states": True}, {"stage": 2}, "requires bf16.bf16_master_weights_and_grads"),
        ({"bf16_master_weights_and_grads": True}, {"stage": 2}, "needs zero_optimization.offload_optimizer"),
        (BOTH, {"stage": 0}, "stage 1, 2 or 3"),
        ({"bf16_master_weights_and_grads": True}, {"stage": 0, "offload_optimizer": {"device": "cpu"}}, "stage 1, 2"),
        ({"rounding": "up"}, {"stage": 2}, "rounding"),
        ({"rounding": "kahan"}, {"stage": 2}, "rounds bf16 master weights"),
    ],
)
def test_bad_bf16_state_configs_are_clear_errors(bf16, zero, match):
    with pytest.raises(ConfigError, match=match):
        dsfunc.Config.load(
            {"train_batch_size": 4, "bf16": {"enabled": True, **bf16}, "zero_optimization": zero}
        )


def test_kahan_masters_track_fp32_where_nearest_and_stochastic_drift():
    """1000 SGD-with-momentum steps, each moving the weights by under half a bf16 ulp: to nearest the bf16 masters
    never move (over 50 ulps behind the fp32 masters), stochastically they wander (several ulps);
    with Kahan compensation they stay within about half an ulp (the masters' own rounding), and master plus
    compensation within a tenth. Deterministic: a second run is bit for bit the first."""
    g = torch.Generator().manual_seed(0)
    start = (1 + torch.rand(4096, generator=g)).bfloat16()
    grads = [-(0.5 + torch.rand(4096, generator=g)) for _ in range(1000)]

    def run(tx, w: torch.Tensor) -> tuple[torch.Tensor, object]:
        p, state = {"w": w}, tx.init({"w": w})
        for grad in grads:
            updates, state = tx.update({"w": grad}, state, p)
            p = {"w": (p["w"] + updates["w"]).to(w.dtype)}
        return p["w"], state

    reference, _ = run(sgd(lr=2**-12, momentum=0.9), start.float())
    ulp = 2.0 ** (torch.floor(torch.log2(reference)) - 7)  # of bf16 at the reference value
    error = {}
    for rounding in ROUNDINGS:
        w, state = run(low_precision(sgd(lr=2**-12, momentum=0.9), rounding, states=False), start)
        assert w.dtype == torch.bfloat16
        error[rounding] = ((w.float() - reference).abs() / ulp).max().item()
    assert ((reference - start.float()) / ulp).min() > 50  # the fp32 masters moved by over 50 ulps
    assert error["kahan"] <= 0.6 and error["nearest"] > 50 and error["stochastic"] > 2, error
    compensated = (w.float() + state.compensation["w"].float() - reference).abs() / ulp
    assert compensated.max() <= 0.1
    again, _ = run(low_precision(sgd(lr=2**-12, momentum=0.9), "kahan", states=False), start)
    assert torch.equal(again, w)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_states_resume_exactly(tmp_path, rounding):
    """3 steps, save, 3 more equals a resumed run's 3 more, bit for bit (the stochastic bits' step, the Kahan
    compensations included)."""

    def fresh() -> dsfunc.TrainState:
        torch.manual_seed(0)
        return dsfunc.init_state(MLP(width=10, depth=3), bf16_config(2, "AdamW", rounding))

    batches = mlp_batches(6, MICRO)
    state = fresh()
    for batch in batches[:3]:
        state = dsfunc.train_step(state, batch)
    dsfunc.save_checkpoint(state, str(tmp_path))
    saved = [c.clone() for c in compensations(state.opt_state)]
    for batch in batches[3:]:
        state = dsfunc.train_step(state, batch)
    resumed, _ = dsfunc.load_checkpoint(str(tmp_path), fresh())
    assert {p.dtype for p in resumed.params.values()} == {torch.bfloat16}
    loaded = compensations(resumed.opt_state)
    assert len(loaded) == len(saved) == (4 if rounding == "kahan" else 0)  # one per unit
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved)) and any(c.any() for c in loaded) == bool(saved)
    for batch in batches[3:]:
        resumed = dsfunc.train_step(resumed, batch)
    a, b = dsfunc.full_params(state), dsfunc.full_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("optimizer", "rounding"), [("AdamW", "nearest"), ("SGD", "kahan"), ("AdamW", "stochastic")])
def test_the_host_s_update_unit_by_unit_and_slice_by_slice_is_the_whole_tree_s(optimizer, rounding):
    """The chain over two units at once (the device's way) and one unit at a time, in slices of 7 elements where
    the chain is element-wise (the host's way, :mod:`dsfunc.optim.low_precision_host`): bit for bit, 3 steps,
    clipped (SGD with momentum too)."""
    from dsfunc.optim.low_precision_host import CHUNK
    from dsfunc.optim.update import UpdateContext

    cfg = dsfunc.Config.load({**bf16_config(2, optimizer, rounding), "train_batch_size": MICRO})
    whole = dsfunc.optim.update_from_config(cfg)
    assert whole.by_unit and whole.chunk == (0 if rounding == "stochastic" else CHUNK)
    g = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(40, generator=g).bfloat16(), "b": torch.randn(23, generator=g).bfloat16()}
    runs = {}
    for host in (False, True):
        update = dataclasses.replace(whole, chunk=7 if whole.chunk else 0)
        params, g = {k: v.clone() for k, v in start.items()}, torch.Generator().manual_seed(1)
        state = update.init(params)
        for _ in range(3):
            grads = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in params.items()}
            norm = torch.sqrt(sum(x.float().pow(2).sum() for x in grads.values()))
            assert norm > CLIP
            ctx = UpdateContext(loss_scale=torch.ones(()), grad_norm=norm, grad_scale=torch.ones(()),
                                finite=torch.tensor(True), skip=torch.tensor(False), lowp={}, segment_norm=None,
                                executor=_OnHost() if host else dsfunc.optim.update.RUN_NOW)
            params, state = update.apply(params, grads, state, ctx)
        runs[host] = (dict(params), optree.tree_leaves(state))
    assert all(torch.equal(runs[False][0][k], runs[True][0][k]) for k in start)
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1], strict=True))


class _OnHost:
    """An executor that runs each unit's work at once, as the host's does."""

    on_host = True

    def run(self, names: list[str], work) -> None:
        for name in names:
            work([name])

    def unit_done(self, name: str, master: torch.Tensor) -> None:
        """Nothing waits."""
