"""The engine's runtime: a script's own ``loss.backward()`` gets the seed at the leaves, and under fp16 needs the
scaled loss ([Note: a backward the runtime does not run] in dsfunc/deepspeed/engine_runtime.py)."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from dsfunc.deepspeed.engine_runtime import EngineRuntime
from dsfunc.zero.runtime import Phase, local_runtime, zero_runtime
from tests.models import MLP, config, mlp_batches


def _loss(model, batch):
    return model(*batch)


class LossAndLogits(MLP):
    """Returns a mapping of the loss and the logits it is computed from, as a Hugging Face model does."""

    def forward(self, x, y):
        logits = super().forward(x)
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, y)}


def test_a_backward_the_script_calls_itself_gets_the_seed_at_the_leaves():
    state = dsfunc.init_state(LossAndLogits(), config(micro=2, gas=2))
    micros = mlp_batches(2, 2)
    reference, direct = local_runtime(state), zero_runtime(state, EngineRuntime)
    for i, micro in enumerate(micros):
        reference.backward(reference.forward(_loss, micro, micro=(i, 2))["loss"])
        reference.end()
        direct.forward(_loss, micro, micro=(i, 2))["loss"].backward()  # loss.backward(), as DeepSpeed scripts may
        assert direct.phase is Phase.FORWARD
        direct.end()
    _, expected = reference.finish()
    loss, grads = direct.finish()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-6, atol=0)
    assert torch.isnan(loss)  # the runtime never saw the loss


def test_a_direct_backward_under_fp16_needs_the_scaled_loss():
    cfg = config(micro=2)
    cfg["fp16"] = {"enabled": True}
    state = dsfunc.init_state(MLP(), cfg)
    runtime = zero_runtime(state, EngineRuntime)
    batch = mlp_batches(1, 2)[0]
    with pytest.raises(dsfunc.UsageError, match=r"fp16 training needs the loss multiplied by the loss scale"):
        runtime.forward(_loss, batch).backward()
    assert all(leaf.grad is None for leaf in runtime.leaves)
    runtime.drop_forward()
    runtime.scale(runtime.forward(_loss, batch)).backward()
    runtime.end()
    _, grads = runtime.finish()
    reference = zero_runtime(state)
    reference.backward(reference.forward(_loss, batch), state.scaler.scale)
    reference.end()
    for name, g in reference.finish()[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=0)
