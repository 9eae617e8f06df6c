"""Every public name of real DeepSpeed 0.19.8's engine answers on dsfunc's, and every config accessor returns
what DeepSpeed's returns for the same config (both engines built by tests/deepspeed/scripts/engine_surface.py,
one process each, on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.deepspeed.engine_surface import NOT_SUPPORTED, NoSyncError
from dsfunc.errors import NotSupportedError
from tests.multiprocess import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "deepspeed", "scripts", "engine_surface.py")

# Methods that act (not accessors): called with no arguments their results say nothing about the config.
ACTIONS = {"backward", "step", "destroy", "collect_python_gc", "allreduce_gradients", "buffered_allreduce_fallback",
           "offload_states", "reload_states", "random_ltd_initialize", "compile_zero_optimization_stage"}
# Where dsfunc answers differently on purpose
DIFFERENT = {
    "get_batch_info": "DeepSpeed returns its three accessor methods uncalled; dsfunc their values",
    "get_data_parallel_rank": "DeepSpeed asserts without its own groups; dsfunc answers the rank",
    "get_model_parallel_rank": "DeepSpeed asserts without its own groups; dsfunc answers 0",
    "get_tensor_parallel_rank": "DeepSpeed asserts without its own groups; dsfunc answers 0",
    "get_sequence_parallel_group": "DeepSpeed raises AttributeError; dsfunc answers None (no sequence parallelism)",
    "was_step_applied": "before the first step DeepSpeed answers False at ZeRO 0-2 and True at ZeRO-3; dsfunc False",
    "steps_per_print": "dsfunc's default is 10 progress-line steps, DeepSpeed 0.19.8's None",
}


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = {}
    for backend in ("deepspeed", "dsfunc"):
        path = str(tmp_path_factory.mktemp("surface") / f"{backend}.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSFUNC_")}
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   DSFUNC_AS_DEEPSPEED="1" if backend == "dsfunc" else "0")
        proc = subprocess.run([sys.executable, SCRIPT, "--backend", backend, "--out", path], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"{backend}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        with open(path) as f:
            out[backend] = json.load(f)
    return out


def test_every_public_name_of_deepspeeds_engine_answers(surfaces):
    ds, ours = surfaces["deepspeed"], surfaces["dsfunc"]
    assert set(ds) == set(ours)
    for label in ds:
        assert len(ds[label]["names"]) > 200
        missing = sorted(set(ds[label]["names"]) - set(ours[label]["names"]))
        assert not missing, f"{label}: DeepSpeedEngine names dsfunc's engine lacks: {missing}"


def test_accessors_return_what_deepspeeds_return(surfaces):
    ds, ours = surfaces["deepspeed"], surfaces["dsfunc"]
    compared = 0
    for label in ds:
        for name, expected in ds[label]["values"].items():
            if name in ACTIONS or name in DIFFERENT:
                continue
            got = ours[label]["values"][name]
            if got == "raises NotSupportedError":
                continue
            assert got == expected, f"{label}: engine.{name}() is {got!r}, DeepSpeed's {expected!r}"
            compared += 1
    assert compared >= 3 * 120


def test_what_dsfunc_does_not_implement_says_so_at_the_call(surfaces):
    refused = {n for v in surfaces["dsfunc"].values() for n, r in v["values"].items() if r == "raises NotSupportedError"}
    assert {"allreduce_gradients", "tensor_parallel_config", "offload_states", "clip_fp32_gradients"} <= refused
    assert refused <= set(NOT_SUPPORTED)  # only the features listed as missing are refused, no accessor


def _engine(config: dict, seed: int = 0) -> dsfunc.Engine:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine, *_ = dsfunc.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


CONFIG = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _micro(engine: dsfunc.Engine, x: torch.Tensor) -> None:
    engine.backward(engine(x).square().mean())


def test_refusals_name_the_feature():
    engine = _engine(CONFIG)
    with pytest.raises(NotSupportedError, match=r"engine\.allreduce_gradients .*gradient reduction"):
        engine.allreduce_gradients()
    with pytest.raises(NotSupportedError, match=r"engine\.losses"):
        _ = engine.losses
    with pytest.raises(NotSupportedError, match="changing the batch size"):
        engine.set_train_batch_size(8)


def test_no_sync_accumulates_into_the_next_step_like_plain_accumulation():
    """Two micro-batches inside no_sync plus one outside, then step, equal three backwards in one micro-batch
    of a fresh engine (dsfunc reduces only when the step ends); a step inside no_sync is an error."""
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    one_step = {**CONFIG, "train_batch_size": 2, "gradient_accumulation_steps": 1}
    a, b = _engine(one_step), _engine(one_step)
    with a.no_sync():
        _micro(a, xs[0])
        _micro(a, xs[1])
        with pytest.raises(NoSyncError, match="illegal to call Engine.step"):  # an AssertionError, as DeepSpeed's
            a.step()
        with pytest.raises(NoSyncError, match="do not nest"), a.no_sync():
            pass
    _micro(a, xs[2])
    a.step()
    for x in xs:
        _micro(b, x)
    b.step()
    for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert a.global_steps == 1 and not a.inside_no_sync_ctxt


def test_no_sync_is_refused_where_gradients_are_partitioned():
    engine = _engine({**CONFIG, "zero_optimization": {"stage": 2}})
    with pytest.raises(AssertionError, match="incompatible with gradient partitioning logic of ZeRO stage 2"), \
            engine.no_sync():
        pass


def test_tput_timer_counts_steps_and_epochs():
    engine = _engine(CONFIG)
    assert engine.tput_timer.avg_samples_per_sec() == float("-inf")
    for _ in range(4):
        for _ in range(2):
            _micro(engine, torch.randn(2, 4))
            engine.step()
    engine.tput_timer.update_epoch_count()
    timer = engine.tput_timer
    assert (timer.global_step_count, timer.micro_step_count, timer.epoch_count) == (4, 0, 1)
    assert timer.total_elapsed_time > 0 and timer.avg_samples_per_sec() > 0
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0


def test_load_module_state_dict_makes_the_weights_the_masters():
    source, target = _engine(CONFIG, seed=1), _engine(CONFIG, seed=2)
    weights = {k: v.detach().clone() for k, v in source.module.state_dict().items()}
    target.load_module_state_dict({"module": weights})
    for name, value in dsfunc.full_params(target.state).items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0)
    x = torch.randn(2, 4)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    with pytest.raises(dsfunc.InputError, match="missing keys"):
        target.load_module_state_dict({"0.weight": weights["0.weight"]})
