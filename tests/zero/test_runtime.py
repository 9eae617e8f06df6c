"""The micro-batch runtime: its phases, its misuse errors, and that it is the one place backward runs."""

from __future__ import annotations

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


def test_phases_follow_forward_backward_end():
    state = dsfunc.init_state(MLP(), config(micro=2, gas=2))
    runtime = zero_runtime(state)
    micros = mlp_batches(2, 2)
    assert runtime.phase is Phase.IDLE
    for i, micro in enumerate(micros):
        loss = runtime.forward(_loss, micro, micro=(i, 2))
        assert runtime.phase is Phase.FORWARD and len(runtime.leaves) == len(state.program.plan.units)
        runtime.backward(loss)
        assert runtime.phase is Phase.BACKWARD
        assert all(t.is_meta for t in state.program.skeleton.parameters())  # unbound after backward
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
    with pytest.raises(dsfunc.UsageError, match=r"forward\(\) in phase FORWARD"):
        runtime.forward(_loss, batch)
    with pytest.raises(dsfunc.UsageError, match=r"end\(\) in phase FORWARD, expected BACKWARD"):
        runtime.end()
    with pytest.raises(dsfunc.InputError, match="the loss has no graph"):
        runtime.backward(loss.detach())
    runtime.backward(loss)
    runtime.end()
    assert torch.equal(runtime.finish()[0], loss.detach())


def test_a_failing_forward_leaves_nothing_bound():
    state = dsfunc.init_state(MLP(), config(micro=2))
    runtime = zero_runtime(state)

    def broken(model, batch):
        model(*batch)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        runtime.forward(broken, mlp_batches(1, 2)[0])
    assert runtime.phase is Phase.IDLE and state.program.workspace.active is None
    assert all(t.is_meta for t in state.program.skeleton.parameters())


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
    calls = [
        f"{path.relative_to(ROOT)}"
        for path in sorted((ROOT / "dsfunc").rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.search(r"autograd\.(backward|grad)\(", line) and not line.lstrip().startswith(("#", "``"))
    ]
    assert calls == ["dsfunc/zero/runtime.py"], calls
