"""Regional compilation: compiled unit forwards give the eager parameters and compile once."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from tests.models import relative_diff
from tests.multiprocess import run_world

STEPS = 10


def gpt(dropout: float = 0.1) -> torch.nn.Module:
    from dsfunc.models.gpt import GPT, GPTConfig, init_weights

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=dropout))
    model.apply(init_weights)
    return model


def config(stage: int, world: int, compile_section: dict | None, precision: str | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if compile_section is not None:
        cfg["compile"] = compile_section
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}
    return cfg


def batches(rank: int, world: int) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, 64, (4 * world, 17), generator=g)[4 * rank : 4 * (rank + 1)]
        out.append((t[:, :-1], t[:, 1:]))
    return out


def train(rank: int, world: int, stage: int, compiled: bool, precision: str | None) -> tuple:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # aot_eager runs AOT autograd's graphs with eager kernels: bitwise the eager step in fp32. In fp16 its
    # decomposed backward rounds differently (torch's numerics, not dsfunc's), so fp16 checks the capture
    # alone ("eager": dynamo's graphs, eager kernels), which is bitwise too.
    backend = "eager" if precision == "fp16" else "aot_eager"
    section = {"enabled": True, "backend": backend} if compiled else None
    state = dsfunc.init_state(gpt(), config(stage, world, section, precision), seed=5)
    graphs, skipped = [], []
    for batch in batches(rank, world):
        state = dsfunc.train_step(state, batch)
        graphs.append(counters["stats"]["unique_graphs"])
        skipped.append(int(state.metrics.skipped))
    return dsfunc.full_params(state), graphs, skipped


def compare(rank: int, world: int, stages: list[int], precision: str | None) -> dict:
    return {stage: (train(rank, world, stage, False, precision), train(rank, world, stage, True, precision))
            for stage in stages}


@pytest.mark.parametrize("world, stages, precision", [(1, [0, 3], None), (2, [0, 1, 2, 3], None), (2, [3], "fp16")])
def test_compiled_units_train_like_eager_and_compile_once(world, stages, precision):
    for rank_result in run_world(compare, world, stages, precision):
        for stage, ((eager, eager_graphs, _), (compiled, graphs, _)) in rank_result.items():
            assert eager_graphs[-1] == 0
            assert relative_diff(compiled, eager) < 1e-5, (world, stage)
            assert graphs[0] >= 1 and graphs[-1] == graphs[0], (stage, graphs)  # nothing compiles after step 1


@pytest.mark.parametrize("host_work", ["cpu_checkpointing", "synchronize_checkpoint_boundary", "profile"])
def test_checkpoint_host_work_stays_outside_the_compiled_units(host_work):
    """Checkpointing's host work (a host copy of what is saved, a sync, a clock) wraps each compiled unit from
    outside: inside its graph dynamo gave up on every unit and ran it eagerly, and said nothing."""
    from torch._dynamo.utils import counters

    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = config(0, 1, {"enabled": True, "backend": "aot_eager"} if compiled else None)
        cfg["activation_checkpointing"] = {"policy": "units", host_work: True}
        state = dsfunc.init_state(gpt(), cfg, seed=5)
        for batch in batches(0, 1)[:3]:
            state = dsfunc.train_step(state, batch)
        out[compiled] = dsfunc.full_params(state)
        if compiled:
            breaks = dict(counters["graph_break"])
            assert counters["stats"]["unique_graphs"] >= 1 and not breaks, breaks
    assert relative_diff(out[True], out[False]) < 1e-5


def test_inductor_forward_matches_eager_and_a_new_shape_recompiles_once(caplog):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = config(0, 1, None)
    eager = dsfunc.init_state(gpt(dropout=0.0), cfg)
    compiled = dsfunc.init_state(gpt(dropout=0.0), cfg, compile=True)
    batch = batches(0, 1)[0]
    eager = dsfunc.train_step(eager, batch)
    compiled = dsfunc.train_step(compiled, batch)
    assert abs(compiled.metrics.loss.item() - eager.metrics.loss.item()) < 1e-5
    first = counters["stats"]["unique_graphs"]
    for batch in batches(0, 1)[1:4]:
        compiled = dsfunc.train_step(compiled, batch)
    assert counters["stats"]["unique_graphs"] == first
    short = [(x[:, :8], y[:, :8]) for x, y in batches(0, 1)[:3]]
    for batch in short:
        compiled = dsfunc.train_step(compiled, batch)
    assert counters["stats"]["unique_graphs"] > first  # a new sequence length compiled...
    grown = counters["stats"]["unique_graphs"]
    for batch in short:
        compiled = dsfunc.train_step(compiled, batch)
    assert counters["stats"]["unique_graphs"] == grown  # ... once


def test_the_config_section_and_init_state_option_agree():
    with pytest.raises(dsfunc.ConfigError, match='compile.backnd".*"compile.backend"'):
        dsfunc.init_state(gpt(), config(0, 1, {"enabled": True, "backnd": "eager"}))
    with pytest.raises(dsfunc.ConfigError, match=r"compile.deepcompile = true: dsfunc does not support DeepSpeed.s compiler \(DeepCompile\)"):
        dsfunc.init_state(gpt(), config(0, 1, None), compile={"deepcompile": True})


def test_cuda_graph_off_cuda_falls_back_to_the_eager_step_and_says_why(caplog):
    cfg = config(0, 1, None)
    eager = dsfunc.init_state(gpt(), cfg, seed=2)
    graphed = dsfunc.init_state(gpt(), cfg, seed=2, compile={"enabled": False, "cuda_graph": True})
    with caplog.at_level("WARNING", logger="dsfunc"):
        for batch in batches(0, 1)[:3]:
            eager = dsfunc.train_step(eager, batch)
            graphed = dsfunc.train_step(graphed, batch)
    assert relative_diff(dsfunc.full_params(graphed), dsfunc.full_params(eager)) == 0.0
    [line] = [r.getMessage() for r in caplog.records if "cuda_graph" in r.getMessage()]
    assert "runs eagerly: the state lives on cpu" in line


def test_deepspeeds_engine_compile_trains_like_eager():
    """``engine.compile(backend=...)`` after ``initialize`` compiles the unit forwards (not the engine's own
    Python, as ``nn.Module.compile`` would), and the compiled engine trains like an eager one."""
    from torch._dynamo.utils import counters

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        net = gpt(dropout=0.0)
        engine, *_ = dsfunc.initialize(model=net, config=config(1, 1, None))
        assert not engine.is_compiled
        if compiled:
            engine.compile(backend="aot_eager")
            assert engine.is_compiled
        for x, y in batches(0, 1)[:4]:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        results.append({k: v.detach().clone() for k, v in net.state_dict().items()})
        assert (counters["stats"]["unique_graphs"] > 0) == compiled
    assert relative_diff(results[1], results[0]) < 1e-5
    with pytest.raises(dsfunc.NotSupportedError, match="DeepCompile"):
        engine.compile(schedule=[(0, "pass")])
