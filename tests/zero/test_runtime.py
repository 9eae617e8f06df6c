"""The micro-batch runtime: its phases, its misuse errors, and that it is the one place backward runs."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest
import torch

import dsfunc
from dsfunc.zero.runtime import Phase, local_runtime, zero_runtime
from tests.models import MLP, config, mlp_batches

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _loss(model, batch):
    return model(*batch)


def unbound(state) -> bool:
    """The skeleton holds its resident parameters (leaves of their own), not a micro-batch's views."""
    return all(isinstance(t, torch.nn.Parameter) and t.grad_fn is None for t in state.program.skeleton.parameters())


def test_phases_follow_forward_backward_end():
    state = dsfunc.init_state(MLP(), config(micro=2, gas=2))
    runtime = zero_runtime(state)
    micros = mlp_batches(2, 2)
    assert runtime.phase is Phase.IDLE
    for i, micro in enumerate(micros):
        loss = runtime.forward(_loss, micro, micro=(i, 2))
        # one rank, gradients taken after backward: the module's own parameters are the leaves
        assert runtime.phase is Phase.FORWARD
        params = list(state.program.skeleton.parameters())
        assert len(runtime.leaves) == len(params) and {id(p) for p in runtime.leaves} == {id(p) for p in params}
        runtime.backward(loss)
        assert runtime.phase is Phase.BACKWARD
        assert unbound(state)  # unbound after backward
        runtime.end()
        assert runtime.phase is Phase.IDLE
    loss, grads = runtime.finish()
    assert grads.keys() == state.params.keys() and all(g is not None for g in grads.values())
    assert torch.isfinite(loss)


def test_calls_out_of_order_are_usage_errors():
    state = dsfunc.init_state(MLP(), config(micro=2))
    runtime = zero_runtime(state)
    batch = mlp_batches(1, 2)[0]
    with pytest.raises(dsfunc.UsageError, match=r"backward\(\) in phase IDLE, expected FORWARD"):
        runtime.backward(torch.ones((), requires_grad=True))
    with pytest.raises(dsfunc.UsageError, match="no micro-batch has run backward"):
        runtime.finish()
    loss = runtime.forward(_loss, batch)
    with pytest.raises(dsfunc.UsageError, match=r"a forward for micro-batch \(1, 2\) while micro-batch \(0, 1\)"):
        runtime.forward(_loss, batch, micro=(1, 2))
    with pytest.raises(dsfunc.UsageError, match=r"end\(\) in phase FORWARD, expected BACKWARD"):
        runtime.end()
    with pytest.raises(dsfunc.InputError, match="the loss has no graph"):
        runtime.backward(loss.detach())
    runtime.backward(loss)
    runtime.end()
    assert torch.equal(runtime.finish()[0], loss.detach())


def _grads_of(state, pairs) -> tuple[torch.Tensor, dict]:
    """One micro-batch of several forward/backward calls: ``pairs`` lists, per backward, the batches whose
    forwards run before it."""
    runtime = local_runtime(state)
    for forwards in pairs:
        losses = [runtime.forward(_loss, batch) for batch in forwards]
        runtime.backward(sum(losses))
    runtime.end()
    return runtime.finish()


def test_several_forwards_and_backwards_in_one_micro_batch_add_up():
    state = dsfunc.init_state(MLP(), config(micro=2))
    a, b = mlp_batches(2, 2)
    loss_one, one = _grads_of(state, [[a, b]])  # two forwards, one backward of the sum
    loss_two, two = _grads_of(state, [[a], [b]])  # a pair, then another pair (a GAN's discriminator)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss_two, loss_one)  # the micro-batch's loss is the sum of its losses
    runtime = local_runtime(state)
    first = runtime.forward(_loss, a)
    second = runtime.forward(_loss, a)  # the binding stays: each parameter a leaf once
    assert len(runtime.leaves) == len(list(state.program.skeleton.parameters()))
    runtime.backward(first, retain_graph=True)
    runtime.backward(second)  # a backward in BACKWARD: another loss of the micro-batch
    runtime.forward(_loss, b)  # a forward no backward follows is dropped by end()
    assert runtime.phase is Phase.FORWARD
    runtime.end()
    loss, _ = runtime.finish()
    torch.testing.assert_close(loss, first.detach() + second.detach())
    assert unbound(state)


def test_two_forwards_of_one_micro_batch_draw_different_dropout_masks():
    state = dsfunc.init_state(MLP(dropout=0.5), config(micro=2))
    runtime = local_runtime(state)
    x, _ = mlp_batches(1, 2)[0]
    first, second = (runtime.forward(lambda model, b: model(b), x) for _ in range(2))
    assert not torch.equal(first, second)
    runtime.drop_forward()
    assert runtime.phase is Phase.IDLE and not runtime.has_gradients
    again = runtime.forward(lambda model, b: model(b), x)
    torch.testing.assert_close(again, first, rtol=0, atol=0)  # the same (step, micro-batch, forward): same masks


def test_a_backward_the_runtime_does_not_run_is_refused():
    """Only the engine's runtime takes a script's own backward (tests/deepspeed/test_engine_runtime.py); in the
    functional step's a gradient from one would miss the seed, so it is an error."""
    state = dsfunc.init_state(MLP(), config(micro=2))
    runtime = local_runtime(state)
    runtime.forward(_loss, mlp_batches(1, 2)[0]).backward()
    with pytest.raises(dsfunc.UsageError, match="from a backward the runtime did not run"):
        runtime.end()


def test_a_failing_forward_leaves_nothing_bound():
    state = dsfunc.init_state(MLP(), config(micro=2))
    runtime = zero_runtime(state)

    def broken(model, batch):
        model(*batch)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        runtime.forward(broken, mlp_batches(1, 2)[0])
    assert runtime.phase is Phase.IDLE and state.program.run.workspace.active is None
    assert unbound(state)


def test_shard_must_be_outside_accumulate():
    state = dsfunc.init_state(MLP(), config(micro=2, gas=2))
    inverted = dsfunc.make_train_step(dsfunc.accumulate()(dsfunc.shard()(dsfunc.value_and_grad(_loss))))
    with pytest.raises(dsfunc.UsageError, match=r"shard\(\) must be outside accumulate\(\)"):
        inverted(state, mlp_batches(1, 4)[0])


def test_local_runtime_refuses_a_sharded_state():
    class Plan:
        ways, stage, world_size = 2, 3, 2

    class Program:
        plan = Plan()

    class State:
        program = Program()

    with pytest.raises(dsfunc.InputError, match=r"without shard\(\) needs unsharded parameters.*stage 3 over 2"):
        local_runtime(State())


def test_autograd_backward_is_called_in_one_place():
    """A training backward runs in the runtime alone. The others differentiate graphs of their own: tiling a slice
    at a time inside an autograd function (dsfunc.tiling), the vocab-parallel loss's gradient inside its autograd
    function (dsfunc.parallel.vocab), and the FLOPs count on a meta copy (monitor/flops)."""
    calls = [
        f"{path.relative_to(ROOT)}"
        for path in sorted((ROOT / "dsfunc").rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.search(r"autograd\.(backward|grad)\(", line) and not line.lstrip().startswith(("#", "``"))
    ]
    assert set(calls) == {"dsfunc/zero/runtime.py", "dsfunc/tiling.py", "dsfunc/parallel/vocab.py",
                          "dsfunc/monitor/flops.py"}, calls


class WithUnused(MLP):
    """An MLP whose first block holds a parameter no loss reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[0].unused = torch.nn.Parameter(torch.ones(3))


def _train(model, cfg, steps: int = 3, hooked: bool = False):
    """The full fp32 parameters after ``steps`` steps; ``hooked``: a hook of the script's own on every parameter
    of the module, which sends each unit down the flat-leaf binding (and must never run)."""
    torch.manual_seed(0)
    state = dsfunc.init_state(model, cfg)
    calls = []
    if hooked:
        for p in state.program.skeleton.parameters():
            p.register_hook(lambda g: calls.append(g))
    for batch in mlp_batches(steps, cfg["train_batch_size"]):
        state = dsfunc.train_step(state, batch)
    assert not calls
    return dsfunc.full_params(state), state


@pytest.mark.parametrize("extra", [{}, {"gas": 2}, {"stage": 2}, {"bf16": {"enabled": True}}],
                         ids=["fp32", "accumulation", "stage2", "bf16"])
def test_the_module_parameters_as_leaves_train_bit_for_bit_as_the_flat_binding(extra):
    cfg = config(micro=2, gas=extra.get("gas", 1), stage=extra.get("stage", 0), gradient_clipping=1.0,
                 **{k: v for k, v in extra.items() if k not in ("gas", "stage")})
    torch.manual_seed(0)
    model = WithUnused()
    as_leaves, state = _train(copy.deepcopy(model), cfg)
    flat, _ = _train(copy.deepcopy(model), cfg, hooked=True)
    for name, value in flat.items():
        assert torch.equal(as_leaves[name], value), name
    decayed = torch.ones(3, dtype=torch.float64) * (1 - 1e-3 * 0.01) ** 3  # a zero gradient: weight decay alone
    torch.testing.assert_close(as_leaves["blocks.0.unused"].cpu().double(), decayed, rtol=1e-6, atol=0)
    assert all(p.grad is None for p in state.program.skeleton.parameters())  # taken off after each backward


def test_a_gradient_of_the_scripts_own_on_a_parameter_is_left_alone():
    cfg = config(micro=2, gradient_clipping=1.0)
    torch.manual_seed(0)
    model = MLP()
    expected, _ = _train(copy.deepcopy(model), cfg)
    torch.manual_seed(0)
    state = dsfunc.init_state(copy.deepcopy(model), cfg)
    param = next(state.program.skeleton.parameters())
    param.grad = torch.full_like(param, 7.0)  # e.g. from a backward the script ran on the module itself
    for batch in mlp_batches(3, 2):
        state = dsfunc.train_step(state, batch)
    assert torch.equal(param.grad, torch.full_like(param, 7.0))  # not added to, not trained on
    for name, value in dsfunc.full_params(state).items():
        assert torch.equal(value, expected[name]), name
