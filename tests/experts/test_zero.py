"""Experts under ZeRO 1-3 (gloo): each MoE layer's experts are reduced over, and sharded over, their
expert-data-parallel ranks, the rest over every rank; clipping and overflow checks see the whole model, each expert
once. A script written against DeepSpeed's MoE API trains as under real DeepSpeed 0.19.8 at ZeRO 1 and 2 (whose
clipping with experts takes the model's norm), at ep 2 and ep 2 x dp 2; ZeRO 3 (beyond DeepSpeed's MoE) trains
as dsfunc's ZeRO 0 (with Lamb, whose per-parameter norms of an expert are taken over its own ranks), with an
all-zero gate sending no token to half the experts on any rank. An inf in one rank's experts skips every rank's
step, and experts train with the optimizer offloaded as at ZeRO 0."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from tests.experts.test_engine import assert_same_runs, launch
from tests.multiprocess import run_world

CLIP = ("--clip", "0.05")  # below every step's norm: clipping scales each step


# each optimizer and stage once, at ep 2 and at ep 2 x dp 2 (all four pairs cost the suite another minute)
@pytest.mark.parametrize(("ranks", "case", "stage"), [(2, "sgd", 1), (4, "adam", 2)])
def test_moe_script_at_zero_1_and_2_trains_like_deepspeed(tmp_path, ranks, case, stage):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    for backend in ("deepspeed", "dsfunc"):
        launch(ranks, "--backend", backend, "--case", case, "--stage", str(stage), *CLIP, "--starve", "--out", out)
    assert min(torch.load(f"{out}.deepspeed.rank0.pt")["norm"]) > 0.05 * 2
    assert_same_runs(ranks, f"{out}.dsfunc", f"{out}.deepspeed", norms=True)
    for rank in range(ranks):
        assert_sharded(torch.load(f"{out}.dsfunc.rank{rank}.pt")["shards"], ranks)


def assert_sharded(shards: dict[str, tuple[int, int]], ranks: int) -> None:
    """Experts' units over their expert-data-parallel ranks (ep 2: half the world), the others over the world."""
    assert any(name.startswith("moe.deepspeed_moe.experts") for name in shards)
    for name, (numel, shard) in shards.items():
        assert shard == -(-numel // (ranks // 2 if name.startswith("moe.deepspeed_moe.experts") else ranks)), name


def test_moe_at_zero_3_trains_like_zero_0_when_experts_get_no_tokens(tmp_path):
    runs = {stage: str(tmp_path / f"stage{stage}") for stage in (0, 3)}
    for stage, out in runs.items():
        launch(4, "--backend", "dsfunc", "--case", "lamb", "--stage", str(stage), *CLIP, "--one", "--out", out)
    assert_same_runs(4, f"{runs[3]}.dsfunc", f"{runs[0]}.dsfunc", norms=True)
    for rank in range(4):
        got = torch.load(f"{runs[3]}.dsfunc.rank{rank}.pt")
        assert all(counts[2:] == [0, 0] for counts in got["counts"])  # experts 2 and 3: no token from any rank
        assert_sharded(got["shards"], 4)


def _inf_in_rank_1s_experts(rank: int, world: int, stage: int) -> tuple[int, bool]:
    from tests.experts.test_moe import Net

    def loss_fn(model: Net, x: torch.Tensor) -> torch.Tensor:  # rank 1: an inf gradient for its experts only
        poison = float("inf") if rank == 1 else 0.0
        return model(x) + poison * sum(p.sum() for p in model.moe.deepspeed_moe.experts.parameters())

    torch.manual_seed(rank)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
    state = dsfunc.init_state(Net(2), config, loss_fn=loss_fn)
    before = dsfunc.full_params(state)
    state = dsfunc.train_step(state, torch.randn(4, 4))
    after = dsfunc.full_params(state)
    return int(state.metrics.skipped), all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("stage", [2, 3])
def test_an_inf_in_one_ranks_experts_makes_every_rank_skip(stage):
    assert run_world(_inf_in_rank_1s_experts, 2, stage) == [(1, True), (1, True)]


def _trained(rank: int, world: int, zero: dict) -> tuple[dict[str, torch.Tensor], float]:
    from tests.experts.test_moe import Net

    torch.manual_seed(rank)  # the experts come from the first of their ranks
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.01,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": zero}
    state = dsfunc.init_state(Net(2), config)
    batches = torch.Generator().manual_seed(7 + rank)
    for _ in range(3):
        state = dsfunc.train_step(state, torch.randn(8, 4, generator=batches))
    return dsfunc.full_params(state), float(state.metrics.grad_norm)


def test_experts_with_the_optimizer_offloaded_train_like_zero_0():
    want = run_world(_trained, 4, {"stage": 0})
    got = run_world(_trained, 4, {"stage": 2, "offload_optimizer": {"device": "cpu"}})
    for (params, norm), (ref, ref_norm) in zip(got, want):
        assert norm == pytest.approx(ref_norm, rel=1e-5) and norm > 0.01 * 2  # clipped
        for name, value in ref.items():
            assert (params[name] - value).abs().max() <= 1e-5 * value.abs().max(), name
