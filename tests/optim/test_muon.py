"""Muon (``"type": "Muon"``): ZeRO 0-3 on 1 and 2 gloo ranks against a one-process reference written here from
the published algorithm (Keller Jordan's Muon as DeepSpeed runs it: momentum EMA, nesterov blend, quintic
Newton-Schulz in bf16, aspect scaling, decoupled decay; Adam for the rest), with clipping; both Newton-Schulz
methods against DeepSpeed's own, bit for bit; DeepSpeed's config keys and its split of the parameters."""

from __future__ import annotations

import itertools
import math
import os

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc.config import ConfigError, parse_optimizer
from dsfunc.errors import InputError
from dsfunc.optim import ParamGroups
from dsfunc.optim.from_config import optimizer_from_config
from dsfunc.optim.muon import (
    NS_METHODS,
    MatrixShards,
    ScaleByMuonState,
    muon,
    muon_groups,
    ns_dtype,
    orthogonalize,
    orthogonalize_all,
    orthogonalize_shards,
    scale_by_muon,
    stacks,
    takes_muon,
)
from dsfunc.zero.layout import chunk_range
from tests.multiprocess import run_world

STEPS, MICRO, SEQ, VOCAB = 5, 2, 5, 11
MUON_LR, ADAM_LR, DECAY, CLIP = 0.05, 0.01, 0.1, 0.3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(6, 10), nn.Linear(6, 10, bias=False)  # tall matrices (10, 6)
        self.down = nn.Linear(10, 6)  # a wide one (6, 10); 180 Muon elements: 2 ranks split gate's middle
        self.norm = nn.LayerNorm(6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))) * torch.sigmoid(self.gate(h)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.proj = nn.Linear(6, 6, bias=False)  # a Muon matrix in the root unit
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.lm_head = nn.Linear(6, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(x))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(h)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g),
            torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


OFFLOAD = {
    "none": {},
    "optimizer": {"offload_optimizer": {"device": "cpu"}},
    "param": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}
SETUPS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "param")]


def muon_config(world: int, stage: int, offload: str = "none") -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Muon",
            "params": {"muon_lr": MUON_LR, "adam_lr": ADAM_LR, "weight_decay": DECAY, "ns_method": "standard"},
        },
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **OFFLOAD[offload]},
    }


def reference_ns(g: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz as published: quintic (3.4445, -4.7750, 2.0315), 5 steps, on the wide orientation, in bf16
    (``"ns_method": "standard"``'s dtype), scaled by sqrt(max(1, rows / cols)) before it returns to fp32."""
    x = g.to(torch.bfloat16)
    x = x.T if g.shape[0] > g.shape[1] else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    x = x.T if g.shape[0] > g.shape[1] else x
    return (x * math.sqrt(max(1.0, g.shape[0] / g.shape[1]))).float()


def reference(world: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, one parameter at a time: clip the global batch's gradients, then Muon (beta 0.95, nesterov)
    on hidden matrices and Adam (betas 0.9, 0.95, eps 1e-10) on the rest, both with decoupled decay."""
    torch.manual_seed(0)
    model = Tiny()
    state: dict[str, dict[str, torch.Tensor]] = {}
    norms = []
    for t, (x, y) in enumerate(batches(world), start=1):
        model.zero_grad()
        loss_fn(model, (x, y)).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        norms.append(norm.item())
        coef = max(1.0, (norm.item() + 1e-6) / CLIP)
        with torch.no_grad():
            for name, p in model.named_parameters():
                g, s = p.grad / coef, state.setdefault(name, {})
                if p.ndim == 2 and "embed" not in name and "lm_head" not in name:
                    m = s["m"] = s.get("m", torch.zeros_like(p)).lerp(g, 0.05)  # as published: an EMA by lerp
                    u = reference_ns(g.lerp(m, 0.95))
                    p.mul_(1 - MUON_LR * DECAY).sub_(MUON_LR * u)
                else:
                    m = s["m"] = 0.9 * s.get("m", torch.zeros_like(p)) + 0.1 * g
                    v = s["v"] = 0.95 * s.get("v", torch.zeros_like(p)) + 0.05 * g * g
                    u = (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-10)
                    p.mul_(1 - ADAM_LR * DECAY).sub_(ADAM_LR * u)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train_ranks(rank: int, world: int, setups: list[tuple[int, str]]) -> dict:
    out = {}
    for stage, offload in setups:
        torch.manual_seed(0)
        # on the CPU as the reference is (where CUDA is present it is the default device, and its bf16 rounding
        # another's)
        state = dsfunc.init_state(Tiny(), muon_config(world, stage, offload), loss_fn=loss_fn, device="cpu")
        norms = []
        for x, y in batches(world):
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            state = dsfunc.train_step(state, (x[mine], y[mine]))
            norms.append(state.metrics.grad_norm.item())
        muon_state = [
            s
            for s in optree.tree_leaves(state.opt_state, is_leaf=lambda s: isinstance(s, ScaleByMuonState))
            if isinstance(s, ScaleByMuonState)
        ]
        out[stage, offload] = {
            "full": dsfunc.full_params(state),
            "offloaded": state.program.run.grads.off_device,
            "norms": norms,
            "units": [u.name for u in state.program.plan.units],
            "momentum": sorted(muon_state[0].momentum),
        }
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_muon_matches_the_reference_at_every_stage(world):
    """ZeRO 0-3, and ZeRO-Offload (the optimizer at stage 2; optimizer and parameters at stage 3)."""
    expected, norms = reference(world)
    assert min(norms) > CLIP  # the clip is active at every step: a wrong clip factor shows
    results = run_world(train_ranks, world, SETUPS, timeout=600)
    for rank, result in enumerate(results):
        for (stage, offload), got in result.items():
            assert got["offloaded"] == (offload != "none")
            assert got["units"][:3] == ["root[adam-params]", "root[muon-params]", "blocks.0[muon-params]"]
            # one state buffer per Muon unit (its momentum), where Adam keeps two
            assert got["momentum"] == ["blocks.0[muon-params]", "blocks.1[muon-params]", "root[muon-params]"]
            assert max(abs(a - b) for a, b in zip(got["norms"], norms)) < 1e-5, (rank, stage)
            diff = max((got["full"][k] - v).abs().max().item() for k, v in expected.items())
            assert diff < 1e-5, (world, rank, stage, diff)


def test_muon_moves_hidden_matrices_by_an_orthogonal_step():
    """One step from zero momentum on a square matrix: the update's singular values are the quintic's, near 1
    (0.7-1.2), whatever the gradient's scale; lr * wd decays the weight first."""
    g = torch.diag(torch.tensor([10.0, 1.0, 0.1])) @ torch.linalg.qr(torch.randn(3, 3))[0]
    w = {"w": torch.ones(3, 3)}
    tx = muon(lr=0.1, weight_decay=0.5)
    updates, state = tx.update({"w": g}, tx.init(w), w)
    step = (updates["w"] + 0.1 * 0.5 * w["w"]) / -0.1
    assert torch.linalg.svdvals(step).min() > 0.6 and torch.linalg.svdvals(step).max() < 1.25
    assert torch.allclose(state["muon"].momentum["w"], 0.05 * g)


SHAPES = [(48, 20), (20, 48), (32, 32), (3, 20, 48)]  # tall, wide, square, a batch (an expert group's)


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_muon_direction_is_deepspeeds_bit_for_bit(method):
    """Three steps of momentum, nesterov blend and Newton-Schulz against DeepSpeed 0.19.8's ``muon_update`` (eager:
    compiled, it rounds elementwise ops differently), gradients growing 100x a step, every shape twice in one
    transform (each pair orthogonalised in one stacked call, DeepSpeed's one matrix at a time); a conv filter against
    the steps of ``muon_update`` (DeepSpeed's own fails on 4-D filters, in its overflow guard)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    real = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon", reason="real DeepSpeed is the reference")
    assert ns_dtype(method, torch.device("cpu")) == real.ns_compute_dtype(method)
    g = torch.Generator().manual_seed(0)
    shapes = {f"{shape}{copy}": shape for shape in SHAPES for copy in "ab"}
    tx = scale_by_muon(ns_method=method)
    state = tx.init({k: torch.zeros(shape) for k, shape in shapes.items()})
    momentum = {k: torch.zeros(shape) for k, shape in shapes.items()}
    for step in range(3):
        grads = {k: torch.randn(shape, generator=g) * 100.0**step for k, shape in shapes.items()}
        ours, state = tx.update({k: v.clone() for k, v in grads.items()}, state)
        for k, grad in grads.items():
            with torch.compiler.set_stance("force_eager"):
                theirs = real.muon_update(grad.clone(), momentum[k], ns_method=method)
            assert torch.equal(ours[k], theirs) and torch.equal(state.momentum[k], momentum[k]), (k, step)
    conv = torch.randn(32, 2, 3, 3, generator=g)  # (out, in, kh, kw): orthogonalised as (32, 18), scaled by 3 / 3
    iterate = real.zeropower_via_gram_newtonschulz if method == "gram" else real.zeropower_via_newtonschulz5
    with torch.compiler.set_stance("force_eager"):
        theirs = iterate(conv.view(32, -1), steps=5) * real._aspect_ratio_scale(3, 3)
    assert torch.equal(orthogonalize(conv, method=method), theirs.view(conv.shape).float())
    if ns_dtype(method, conv.device) != torch.float32:  # the half dtype shows: fp32 gives other values
        assert not torch.equal(NS_METHODS[method](conv.view(32, -1), 5, torch.float32), theirs)


def test_compiled_direction_is_deepspeeds_compiled_within_rounding():
    """Compiled (as on a GPU), three tall matrices' Gram Newton-Schulz, aspect scale and cast in one stacked call
    against DeepSpeed's compiled ``muon_update`` of each given the same blend (beta 0 without nesterov hands it the
    gradient): inductor rounds the stacked iteration as it does not DeepSpeed's 2-D one (see the module's
    docstring), by 0.7% of the largest entry in fp16, where a wrong matrix or aspect scale is off by 50% or more."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    real = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon", reason="real DeepSpeed is the reference")
    g = torch.Generator().manual_seed(1)
    blends = [torch.randn(48, 20, generator=g) * 10 for _ in range(3)]
    ours = dict(orthogonalize_all(blends, compiled=True))
    for i, blend in enumerate(blends):
        theirs = real.muon_update(blend.clone(), torch.zeros_like(blend), beta=0.0, nesterov=False)
        assert (ours[i] - theirs).abs().max() < 0.02 * theirs.abs().max(), i
        assert not torch.equal(orthogonalize(blend, compiled=False), ours[i])  # the compiled rounding shows


MIXED = [(10, 6), (6, 10), (10, 6), (4, 2, 3, 3), (10, 6), (4, 2, 3, 3), (3, 6, 10), (7, 7)]


def test_stacked_calls_are_each_matrix_alone_bit_for_bit():
    """Every matrix of a mix of shapes (repeated ones, tall, wide, conv filters, an expert batch) orthogonalised in
    stacked calls, whole groups or split to fit ``max_elements``, is its own call's result, each exactly once."""
    g = torch.Generator().manual_seed(2)
    us = [torch.randn(shape, generator=g) for shape in MIXED]
    assert stacks(us) == [[0, 2, 4], [1], [3, 5], [6], [7]]
    assert stacks(us, max_elements=130) == [[0], [2, 4], [1], [3], [5], [6], [7]]  # 180 of (10, 6): 2 parts
    alone = [orthogonalize(u) for u in us]
    for limit in (2**28, 130):
        got = list(orthogonalize_all(us, max_elements=limit))
        assert sorted(i for i, _ in got) == list(range(len(us)))
        for i, update in got:
            assert update.shape == us[i].shape and torch.equal(update, alone[i]), (limit, i)


def test_sharded_matrices_are_orthogonalised_whole_across_units():
    """Two units of a flat buffer split over 2 ranks (gathered here in one process): each rank's slices, put
    together, are every whole matrix's update, the straddling ones included, matrices of one shape from both units
    orthogonalised in one call; the padding is zero (the last rank's shard runs past the unit)."""
    g = torch.Generator().manual_seed(3)
    units = {"u0": [(10, 6), (4, 2, 3, 3), (6, 10)], "u1": [(10, 6), (4, 2, 3, 3), (10, 6), (3, 5)]}
    matrices = {k: [torch.randn(shape, generator=g) for shape in shapes] for k, shapes in units.items()}
    flats, layouts = {}, {0: {}, 1: {}}
    for key, shapes in units.items():
        numel = sum(math.prod(shape) for shape in shapes)
        flats[key] = F.pad(torch.cat([m.reshape(-1) for m in matrices[key]]), (0, numel % 2))
        offsets = tuple(itertools.accumulate((math.prod(shape) for shape in shapes[:-1]), initial=0))
        parts = flats[key].chunk(2)
        for rank in (0, 1):
            def gather(shard, parts=parts, rank=rank):  # an all-gather of the two ranks' shards
                return torch.cat([shard if other == rank else part for other, part in enumerate(parts)])

            layouts[rank][key] = MatrixShards(tuple(shapes), offsets, chunk_range(numel, 2, rank), gather)
    out = [orthogonalize_shards({k: f.chunk(2)[rank] for k, f in flats.items()}, layouts[rank], 5, "gram")
           for rank in (0, 1)]
    assert layouts[0]["u0"].local[1] - layouts[0]["u0"].offsets[1] in range(1, 72)  # the filter straddles
    for key, ms in matrices.items():
        whole = torch.cat([out[0][key], out[1][key]])
        expected = torch.cat([orthogonalize(m).reshape(-1) for m in ms])
        assert torch.equal(whole[: len(expected)], expected), key
        assert not whole[len(expected):].any()


def test_deepspeed_rule_picks_the_muon_parameters():
    assert takes_muon("blocks.0.attn.weight", (4, 4)) and takes_muon("conv.weight", (2, 3, 3, 3))
    assert not takes_muon("blocks.0.attn.bias", (4,))
    assert not takes_muon("model.embed_tokens.weight", (9, 4)) and not takes_muon("lm_head.weight", (9, 4))
    assert not takes_muon("Embedding.weight", (9, 4))  # case-insensitive, as DeepSpeed's name.lower()


def test_halves_resolve_lr_as_deepspeed_does():
    """The config's shared value, then muon_lr / adam_lr, then the group's own; a half with no lr takes
    MuonWithAuxAdam's default."""
    shapes = {"w": (4, 4), "b": (4,), "v": (4, 4)}
    plain = muon_groups(shapes, parse_optimizer({"type": "muon", "params": {}}).params)
    assert plain.options == {
        "muon-params": {"lr": 0.02, "use_muon": True},
        "adam-params": {"lr": 3e-4, "use_muon": False},
    }
    params = parse_optimizer({"type": "Muon", "params": {"lr": 0.1, "adam_lr": 0.2, "momentum": 0.9}}).params
    groups = ParamGroups(
        label=lambda n: "x" if n == "v" else "y", options={"x": {"lr": 0.5, "betas": (0.8, 0.9)}}
    )
    split = muon_groups(shapes, params, groups)
    assert split.label_of("v") == "x-muon-params" and split.label_of("b") == "y-adam-params"
    assert split.options["x-muon-params"] == {"lr": 0.5, "use_muon": True}  # betas are the Adam half's
    assert split.options["y-muon-params"] == {"lr": 0.1, "use_muon": True}
    assert split.options["y-adam-params"] == {"lr": 0.2, "use_muon": False}
    # a group's use_muon overrides the name rule, as MuonWithAuxAdam's groups say which half they are
    shapes = {"wte.weight": (9, 4), "h.weight": (4, 4), "embed.weight": (9, 4), "h.bias": (4,)}
    chosen = ParamGroups(label=lambda n: n.split(".")[0], options={"wte": {"use_muon": False}, "embed": {"use_muon": True}})
    split = muon_groups(shapes, params, chosen)
    assert [split.label_of(n) for n in shapes] == ["wte-adam-params", "h-muon-params", "embed-muon-params",
                                                   "h-adam-params"]


def test_config_keys_and_defaults_are_deepspeeds():
    params = parse_optimizer({"type": "muon", "params": {}}).params
    assert params == {
        "lr": None,
        "muon_lr": None,
        "adam_lr": None,
        "momentum": 0.95,
        "weight_decay": 0.0,
        "ns_method": "gram",
        "betas": (0.9, 0.95),
        "eps": 1e-10,
        "adam_w_mode": True,
        "torch_adam": False,
    }
    with pytest.raises(ConfigError, match="per_head_muon"):
        parse_optimizer({"type": "Muon", "params": {"per_head_muon": True}})
    with pytest.raises(ConfigError, match="ns_method"):
        parse_optimizer({"type": "Muon", "params": {"ns_method": "svd"}})
    with pytest.raises(InputError, match="init_state"):
        optimizer_from_config("Muon", {}, None)


def test_use_muon_under_another_optimizer_is_a_clear_error():
    groups = ParamGroups(label=lambda n: "head" if n.startswith("0") else "rest", options={"head": {"use_muon": False}})
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(InputError, match="'head' sets use_muon.*'adamw'"):
        dsfunc.init_state(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), config, param_groups=groups, device="cpu")


def test_a_flat_shard_without_its_layout_is_a_clear_error():
    tx = muon()
    flat = {"unit": torch.ones(12)}
    with pytest.raises(InputError, match="matrices"):
        tx.update(flat, tx.init(flat), flat)


def test_the_engine_shows_deepspeeds_two_groups():
    """DeepSpeed's engine optimizer holds the Muon half first, then the Adam half, each with its lr."""
    engine, optimizer, _, _ = dsfunc.initialize(model=Tiny(), config=muon_config(1, 0))
    assert engine.get_lr() == [MUON_LR, ADAM_LR]
    assert [(g["use_muon"], len(g["params"])) for g in optimizer.param_groups] == [(True, 7), (False, 11)]


def test_muon_resumes_exactly(tmp_path):
    def fresh() -> dsfunc.TrainState:
        torch.manual_seed(0)
        return dsfunc.init_state(Tiny(), muon_config(1, 1), loss_fn=loss_fn)

    data = batches(1)
    state = fresh()
    for batch in data[:2]:
        state = dsfunc.train_step(state, batch)
    dsfunc.save_checkpoint(state, str(tmp_path))
    for batch in data[2:]:
        state = dsfunc.train_step(state, batch)
    resumed, _ = dsfunc.load_checkpoint(str(tmp_path), fresh())
    for batch in data[2:]:
        resumed = dsfunc.train_step(resumed, batch)
    a, b = dsfunc.full_params(state), dsfunc.full_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
