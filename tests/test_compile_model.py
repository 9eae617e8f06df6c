"""``compile.scope = "model"``: the whole model's forward, loss inside, as one graph that trains like eager and
compiles once, in the functional step and in the DeepSpeed engine; refused where one graph cannot hold it."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import register_backend
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

import dsfunc
from tests.models import relative_diff
from tests.test_compile import batches, config, gpt

GRAPHS: list[torch.fx.GraphModule] = []  # what the recording backend was given, in order


@register_backend(name="dsfunc_test_recording")
def _recording(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """aot_eager (AOT autograd's graphs, eager kernels: bitwise the eager step in fp32) that keeps each graph."""
    GRAPHS.append(gm)
    return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)


def is_compiled(module: torch.nn.Module) -> bool:
    return hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")


def whole(**extra: object) -> dict:
    return {"enabled": True, "backend": "dsfunc_test_recording", "scope": "model", **extra}


def train(stage: int, section: dict | None, remat: str = "none", steps: int = 4) -> tuple:
    torch._dynamo.reset()
    counters.clear()
    GRAPHS.clear()
    cfg = config(stage, 1, section)
    cfg["activation_checkpointing"] = {"policy": remat}
    # On CPU: on CUDA a compiled checkpointed forward draws its dropout from torch's functionalized (philox) RNG,
    # other masks than the eager step's, so only the CPU run can be compared bit for bit
    state = dsfunc.init_state(gpt(), cfg, seed=5, device="cpu")
    graphs = []
    for batch in batches(0, 1)[:steps]:
        state = dsfunc.train_step(state, batch)
        graphs.append(len(GRAPHS))
    return dsfunc.full_params(state), graphs, state


@pytest.mark.parametrize("stage, remat", [(0, "none"), (2, "none"), (0, "units"), (2, "selective")])
def test_the_whole_model_is_one_graph_that_trains_like_eager_and_compiles_once(stage, remat):
    eager, no_graphs, _ = train(stage, None, remat)
    compiled, graphs, state = train(stage, whole(), remat)
    assert no_graphs[-1] == 0
    assert relative_diff(compiled, eager) == 0.0, (stage, remat)
    assert graphs == [1] * len(graphs), graphs  # one graph, in step 1; rebinding each micro-batch recompiles nothing
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    [graph] = GRAPHS
    calls = {getattr(n.target, "__name__", str(n.target)) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"embedding", "layer_norm", "cross_entropy"} <= calls, calls  # the root's work, the loss inside
    # the parameters are graph inputs (rebound per micro-batch), not constants baked into the graph
    inputs = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
    assert sum("parameters" in n for n in inputs) == len(dict(gpt().named_parameters())), inputs
    assert not any(is_compiled(b) for b in state.program.skeleton.blocks)  # the units are not compiled alone


def test_the_engine_compiles_the_whole_model_from_its_config_and_from_engine_compile():
    """``initialize`` with ``compile.scope = "model"``, and ``engine.compile()`` on an engine whose config says
    that scope, compile the model's forward (not the engine's Python) and train like an eager engine."""
    results = []
    for how in ("eager", "config", "engine.compile"):
        torch._dynamo.reset()
        GRAPHS.clear()
        net = gpt(dropout=0.0)
        section = whole() if how == "config" else {"enabled": False, "scope": "model"}
        engine, *_ = dsfunc.initialize(model=net, config=config(1, 1, section))
        if how == "engine.compile":
            engine.compile(backend="dsfunc_test_recording")
        assert engine.is_compiled == (how != "eager")
        for x, y in batches(0, 1)[:3]:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        results.append({k: v.detach().clone() for k, v in net.state_dict().items()})
        assert len(GRAPHS) == (0 if how == "eager" else 1), how
        if how != "eager":
            assert is_compiled(net) and not any(is_compiled(b) for b in net.blocks)
    assert relative_diff(results[1], results[0]) < 1e-6
    assert relative_diff(results[2], results[0]) < 1e-6


def test_a_second_state_on_the_module_undoes_the_whole_model_compilation():
    net = gpt(dropout=0.0)
    dsfunc.init_state(net, config(0, 1, whole()), in_place=True)
    assert is_compiled(net)
    dsfunc.init_state(net, config(0, 1, None), in_place=True)
    assert "forward" not in net.__dict__ and "_dsfunc_own_forward" not in net.__dict__


def test_what_one_graph_cannot_hold_is_refused_with_what_to_use_instead():
    with pytest.raises(dsfunc.ConfigError, match=r'compile.scope = "model" is invalid with zero_optimization.stage 3'
                                                  r'.*Use compile.scope "units"'):
        dsfunc.init_state(gpt(), config(3, 1, whole()))
    cfg = config(0, 1, whole())
    cfg["activation_checkpointing"] = {"policy": "units", "profile": True}
    with pytest.raises(dsfunc.ConfigError, match=r"activation_checkpointing.profile = true: it runs host work"):
        dsfunc.init_state(gpt(), cfg)
    with pytest.raises(dsfunc.ConfigError, match=r'compile.scope = "whole" is invalid: expected one of "units", "model"'):
        dsfunc.init_state(gpt(), config(0, 1, {"enabled": True, "scope": "whole"}))
