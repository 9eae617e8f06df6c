"""``torch.func`` transforms over the engine and its module (DeepSpeed's tests/unit/v1/zero/test_zero_torch_func.py):
a forward under ``grad``/``jacrev``/``vmap`` is a function of its inputs on the current weights, not a micro-batch
of the step, so it gives the plain module's derivatives (GAS does not scale them) at every ZeRO stage, and training
through the engine afterwards is untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dsfunc.deepspeed import initialize
from tests.models import config


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_func_over_the_engine_and_its_module(stage):
    torch.manual_seed(0)
    model = Tiny()
    plain = copy.deepcopy(model)
    engine, *_ = initialize(model=model, config=config(micro=1, gas=4, stage=stage,
                                                       optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    x = torch.randn(8)
    batch = torch.stack([x, x + 0.1, x - 0.1])
    for f, g in [(engine, plain), (engine.module, plain)]:
        assert torch.allclose(torch.func.grad(f)(x), torch.func.grad(g)(x), atol=1e-6)
        assert torch.allclose(torch.func.jacrev(f)(x), torch.func.jacrev(g)(x), atol=1e-6)
        assert torch.allclose(torch.func.vmap(torch.func.grad(f))(batch), torch.func.vmap(torch.func.grad(g))(batch),
                              atol=1e-6)
        assert torch.allclose(torch.func.vmap(f)(batch), torch.func.vmap(g)(batch), atol=1e-6)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    if stage < 3:  # at ZeRO-3 the module's own parameters are empty outside a forward, as DeepSpeed's
        grads = torch.func.grad(lambda p: torch.func.functional_call(engine.module, p, (x,)))(params)
        expected = torch.func.grad(lambda p: torch.func.functional_call(plain, p, (x,)))(params)
        assert all(torch.allclose(grads[k], expected[k], atol=1e-6) for k in expected)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)  # then a step through the engine trains as usual
    for i in range(4):
        engine.backward(engine(x + i))
        engine.step()
        (plain(x + i) / 4).backward()
    optimizer.step()
    assert torch.allclose(torch.func.grad(engine)(x), torch.func.grad(plain)(x), atol=1e-5)
