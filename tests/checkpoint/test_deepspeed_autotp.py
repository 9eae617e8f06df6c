"""DeepSpeed's own AutoTP checkpoint (real DeepSpeed 0.19.8 on CPU: ``tensor_parallel.autotp_size`` 2 at ZeRO 1, two
gloo ranks, each writing its tp part) loads into dsfunc as the global model and trains on like DeepSpeed: AdamW with
clipping, its moments joined from both tp ranks' optimizer files; ``dsfunc export`` writes the global model. It loads
into a dsfunc state at tp 2 and tp 2 x dp 2 too (each rank slicing its parts out of the global model) and trains on
alike. DeepSpeed runs once for the module."""

from __future__ import annotations

import os

import pytest
import torch

import dsfunc
from tests.multiprocess import run_world
from tests.parallel import tp_runs as runs

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

SAVED, MORE, MICRO = 2, 3, 2
# per step: two micro-batches of MICRO samples, the same on both tp ranks (AutoTP's ranks share their data)
CONFIG = {"train_batch_size": 2 * MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
          "optimizer": runs.ADAMW, "zero_optimization": {"stage": 1}, "steps_per_print": 1000}


def _batch(step: int) -> dict[str, torch.Tensor]:
    return {k: v[: 2 * MICRO] for k, v in runs.batch(step).items()}


def deepspeed_autotp(rank: int, world: int, save_dir: str) -> dict:
    """DeepSpeed at tp 2: SAVED steps, save, MORE steps; its losses after the save and its weights at the save."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    optimizer = {"type": "AdamW", "params": {**runs.ADAMW["params"], "torch_adam": True}}
    config = {**CONFIG, "train_batch_size": 2 * CONFIG["train_batch_size"], "optimizer": optimizer,
              "tensor_parallel": {"autotp_size": 2}}  # DeepSpeed counts both tp ranks in the batch
    model = runs.llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    _engine_steps(engine, range(SAVED))
    engine.save_checkpoint(save_dir)
    return {"losses": _engine_steps(engine, range(SAVED, SAVED + MORE))}


def _engine_steps(engine, steps: range) -> list[float]:
    """The engine's steps of ``steps``, two micro-batches each (as a DeepSpeed script runs them): each step's mean
    loss."""
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(2):
            loss = engine(**{k: v.chunk(2)[micro] for k, v in _batch(step).items()}).loss
            engine.backward(loss)
            engine.step()
            total += float(loss) / 2
        losses.append(total)
    return losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple:
    """DeepSpeed's checkpoint folder and its losses after the save."""
    folder = tmp_path_factory.mktemp("autotp")
    return folder, run_world(deepspeed_autotp, 2, str(folder), timeout=900)[0]["losses"]


def dsfunc_tp(rank: int, world: int, save_dir: str) -> dict:
    """dsfunc at tp 2 (the engine, as a DeepSpeed script spells it): load, MORE steps; its losses, and the global
    model it loaded."""
    engine, *_ = dsfunc.initialize(model=runs.llama(), config={**CONFIG, "tensor_parallel": {"autotp_size": 2}})
    engine.load_checkpoint(save_dir)
    loaded = dsfunc.full_params(engine.state)
    losses = _engine_steps(engine, range(SAVED, SAVED + MORE))
    return {"losses": losses, "loaded": loaded, "step": int(engine.state.step)}


def dsfunc_tp_dp(rank: int, world: int, save_dir: str) -> dict:
    """dsfunc at tp 2 x dp 2 (the functional API; ZeRO's shards cut the tp-local parameters): load, MORE steps on
    this rank's data-parallel slice of each batch; its losses, and the global model it loaded."""
    config = {**CONFIG, "tensor_parallel": {"autotp_size": 2}}
    state, _ = dsfunc.load_checkpoint(save_dir, dsfunc.init_state(runs.llama(), config))
    loaded = dsfunc.full_params(state)
    dp = state.program.mesh.group("dp")
    losses = []
    for step in range(SAVED, SAVED + MORE):
        state = dsfunc.train_step(state, {k: v.chunk(dp.size)[dp.rank] for k, v in _batch(step).items()})
        losses.append(float(state.metrics.loss))
    return {"losses": losses, "loaded": loaded, "step": int(state.step)}


def test_deepspeed_autotp_checkpoint_loads_and_trains_on_like_deepspeed(saved):
    tmp_path, want = saved
    assert sorted(p.name for p in (tmp_path / f"global_step{SAVED}").iterdir() if "mp_rank_01" in p.name) == [
        "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    state, _ = dsfunc.load_checkpoint(tmp_path, dsfunc.init_state(runs.llama(), CONFIG))
    assert int(state.step) == SAVED
    loaded = dsfunc.full_params(state)
    dsfunc.export_fp32(tmp_path, tmp_path / "model.pt")  # dsfunc export: the global model, offline
    exported = torch.load(tmp_path / "model.pt")
    assert exported.keys() == loaded.keys() and all((exported[k] == loaded[k]).all() for k in loaded)
    losses = []
    for step in range(SAVED, SAVED + MORE):
        state = dsfunc.train_step(state, _batch(step))
        losses.append(float(state.metrics.loss))
    assert losses[-1] < losses[0] - 1e-3  # it trains on: a wrong moment would show in the later losses
    for got, expected in zip(losses, want):
        assert abs(got - expected) <= 1e-5 * abs(expected), (losses, want)


@pytest.mark.parametrize(("run", "world"), [(dsfunc_tp, 2), (dsfunc_tp_dp, 4)])
def test_deepspeed_autotp_checkpoint_loads_at_tp2_and_trains_on_like_deepspeed(saved, run, world):
    tmp_path, want = saved
    whole = dsfunc.full_params(dsfunc.load_checkpoint(tmp_path, dsfunc.init_state(runs.llama(), CONFIG))[0])
    for got in run_world(run, world, str(tmp_path), timeout=900):
        assert got["step"] == SAVED + MORE
        assert got["loaded"].keys() == whole.keys() and all(torch.equal(got["loaded"][k], whole[k]) for k in whole)
        for loss, expected in zip(got["losses"], want, strict=True):
            assert abs(loss - expected) <= 1e-5 * abs(expected), (got["losses"], want)
