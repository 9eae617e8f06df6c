"""A step replayed from a CUDA graph equals the eager step (GPU only)."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from tests.models import relative_diff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpt() -> torch.nn.Module:
    from dsfunc.models.gpt import GPT, GPTConfig, init_weights

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64))
    model.apply(init_weights)
    return model


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "bf16"), (2, "fp16")])
def test_graphed_steps_equal_eager_steps(stage, precision):
    cfg = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":  # overflows first: skipped steps inside the graph
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 28, "hysteresis": 1, "loss_scale_window": 3}
    eager = dsfunc.init_state(gpt(), cfg)
    graphed = dsfunc.init_state(gpt(), cfg, compile={"enabled": False, "cuda_graph": True})
    g = torch.Generator().manual_seed(0)
    skipped = []
    for _ in range(12):
        tokens = torch.randint(0, 256, (8, 65), generator=g).cuda()
        batch = (tokens[:, :-1], tokens[:, 1:])
        eager = dsfunc.train_step(eager, batch)
        graphed = dsfunc.train_step(graphed, batch)
        assert torch.equal(graphed.metrics.loss, eager.metrics.loss)
        assert graphed.metrics.lr.item() == eager.metrics.lr.item()
        skipped.append(int(graphed.metrics.skipped))
    assert graphed.program.step_fn.graph is not None  # it did capture
    assert int(graphed.step) == 12 and graphed.scaler.scale.item() == eager.scaler.scale.item()
    assert relative_diff(dsfunc.full_params(graphed), dsfunc.full_params(eager)) == 0.0
    if precision == "fp16":  # some replayed steps overflowed and were skipped (the first two run eagerly)
        assert any(skipped[2:]) and not all(skipped), skipped


def test_a_graphed_step_of_the_whole_compiled_model_captures_on_strided_batches():
    """The model scope's compiled forward guards on its inputs' strides: the graph's batch copy keeps them, so the
    capture does not compile anew (which cannot be done inside a capture)."""
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    compiled = {"enabled": True, "scope": "model"}
    eager = dsfunc.init_state(gpt(), cfg, compile=compiled)
    graphed = dsfunc.init_state(gpt(), cfg, compile={**compiled, "cuda_graph": True})
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        tokens = torch.randint(0, 256, (8, 65), generator=g).cuda()
        batch = (tokens[:, :-1], tokens[:, 1:])  # row stride 65, width 64
        eager, graphed = dsfunc.train_step(eager, batch), dsfunc.train_step(graphed, batch)
        torch.testing.assert_close(graphed.metrics.loss, eager.metrics.loss, rtol=1e-3, atol=1e-3)
    assert graphed.program.step_fn.graph is not None
