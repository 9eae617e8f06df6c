"""ZeRO-Offload on a GPU (skips without CUDA): the device memory it saves, measured, and the same training.

The saving is the fp32 master shard and both Adam moments, 12 bytes per parameter of the shard, moved to
host memory, and at stages 2-3 (or without accumulation) the gradient shard too (4 more in fp32, 2 where bf16
holds it exactly: each unit's gradient leaves for a pinned host buffer as backward makes it); the bf16 compute
copy stays on the device.
"""

from __future__ import annotations

import gc

import pytest
import torch

import dsfunc
from dsfunc.models.gpt import GPT, GPTConfig, init_weights
from tests.models import MLP, config, mlp_batches, relative_diff
from tests.zero.test_offload import host_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# about 300M parameters (the tied embedding once): big enough that model states dwarf activations at this batch
BIG = GPTConfig(vocab_size=50304, seq_len=128, n_layer=12, n_head=16, d_model=1280)
SMALL = GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, d_model=128)


def gpt(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    model.apply(init_weights)
    return model


def ds_config(stage: int, offload: bool, precision: str | None, gas: int = 2) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4 // gas, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    if precision:
        cfg[precision] = {"enabled": True}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def batches(cfg: GPTConfig, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):  # 4 samples a step: 2 micro-batches of 2, or one of 4
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def run(cfg: GPTConfig, stage: int, offload: bool, precision: str | None, steps: int, gas: int = 2) -> dict:
    """Train ``steps`` steps on cuda:0; the peak device memory from before the state was built."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    config = ds_config(stage, offload, precision, gas)
    state = dsfunc.init_state(gpt(cfg), config, device="cuda:0")
    for batch in batches(cfg, steps):
        state = dsfunc.train_step(state, batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out = {
        "peak": peak, "shard": sum(p.numel() for p in state.params.values()),
        "full": {k: v.cpu() for k, v in dsfunc.full_params(state).items()}, "loss": state.metrics.loss.item(),
        "on_host": all(p.device.type == "cpu" for p in state.params.values()),
        "pinned_masters": any(p.is_pinned() for p in state.params.values()),
    }
    host = host_of(state)
    if host is not None:
        buffers = host.buffers()
        out["buffers_pinned"] = bool(buffers) and all(b.is_pinned() for b in buffers)
        out["grad_dtypes"] = host.grads.dtypes()
    del state
    gc.collect()
    torch.cuda.empty_cache()
    return out


@needs_cuda
@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_offload_frees_12_bytes_per_parameter_of_the_shard(stage):
    on_device = run(BIG, stage, False, "bf16", steps=2)
    offloaded = run(BIG, stage, True, "bf16", steps=2)
    assert offloaded["on_host"] and not on_device["on_host"]
    assert offloaded["buffers_pinned"] and not offloaded["pinned_masters"]  # only what the GPU copies with
    saved = on_device["peak"] - offloaded["peak"]
    assert saved >= 12 * offloaded["shard"], (on_device["peak"], offloaded["peak"], offloaded["shard"])
    assert abs(on_device["loss"] - offloaded["loss"]) < 1e-2


@needs_cuda
def test_without_accumulation_the_gradient_shard_leaves_the_device_too():
    on_device = run(BIG, 2, False, "bf16", steps=2, gas=1)
    offloaded = run(BIG, 2, True, "bf16", steps=2, gas=1)
    assert offloaded["grad_dtypes"] == {torch.bfloat16}  # one micro-batch on one rank: bf16 holds it exactly
    saved = on_device["peak"] - offloaded["peak"]
    # The run on the device keeps this gradient in bf16 too (dsfunc.zero.reduce.grad_dtype) and peaks in its update:
    # 16 bytes per parameter and the widened gradient of the largest unit (the 64M-parameter tied embedding).
    # The offloaded run holds 2 and peaks in backward instead, at the embedding, where autograd's own
    # temporaries (the embedding's and the head's gradients, the fp32 logits) are alive: 0.8 GiB at this batch,
    # so 12.1-12.4 bytes per parameter were measured (bench/RESULTS.md). A gradient shard that stayed on the
    # device would be alive beside those temporaries and leave about 10.
    assert saved >= 12 * offloaded["shard"], (on_device["peak"], offloaded["peak"], offloaded["shard"])
    assert abs(on_device["loss"] - offloaded["loss"]) < 1e-2


def train_mlp(stage: int, zero_extra: dict, precision: str | None, steps: int = 4, gas: int = 2) -> tuple[dict, float]:
    """The LayerNorm-free MLP of the CPU tests on cuda:0 (the GPT's key bias has a zero gradient, which Adam
    turns into steps of +-lr from rounding noise: no two Adam implementations agree on it)."""
    torch.manual_seed(0)
    cfg = config(micro=4 // gas, gas=gas, stage=stage, gradient_clipping=1.0)
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, **zero_extra)
    if precision:
        cfg[precision] = {"enabled": True}
    state = dsfunc.init_state(MLP(width=64, depth=3), cfg, device="cuda:0")
    for batch in mlp_batches(steps, 4):
        state = dsfunc.train_step(state, batch)
    torch.cuda.synchronize()
    if "offload_param" in zero_extra:
        assert not host_of(state).shards.kept  # nothing of a gathered unit stays on the device between gathers
    return {k: v.cpu() for k, v in dsfunc.full_params(state).items()}, state.metrics.loss.item()


OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


@needs_cuda
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_on_the_gpu_trains_like_the_run_on_the_device(stage):
    on_device, loss = train_mlp(stage, {}, None)
    offloaded, offloaded_loss = train_mlp(stage, OFFLOAD, None)
    assert relative_diff(offloaded, on_device) < 1e-5
    assert abs(offloaded_loss - loss) < 1e-5 * abs(loss)


@needs_cuda
def test_parameter_offload_at_stage3_on_the_gpu_trains_like_the_run_on_the_device():
    on_device, loss = train_mlp(3, {}, "bf16")
    offloaded, offloaded_loss = train_mlp(3, {**OFFLOAD, "offload_param": {"device": "cpu"}}, "bf16")
    assert relative_diff(offloaded, on_device) < 1e-2 and abs(offloaded_loss - loss) < 1e-2


@needs_cuda
@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("stage", [2, 3])
def test_sums_kept_on_the_gpu_train_bit_for_bit(stage, gas):
    """The MLP's three 4,160-element blocks (of four units with the 708-element root) keep their sums on the
    device: the root's copies out and back skip them, and the host update reads them through two host buffers,
    each copied in on the copy stream while the update of the unit before runs: the same sums, bit for bit."""
    sent, loss = train_mlp(stage, OFFLOAD, "bf16", gas=gas)
    kept = {"offload_optimizer": {**OFFLOAD["offload_optimizer"], "grad_accumulation_on_device": 3 * 4160}}
    on_device, on_device_loss = train_mlp(stage, kept, "bf16", gas=gas)
    assert relative_diff(on_device, sent) == 0.0 and on_device_loss == loss
