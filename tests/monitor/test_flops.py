"""Model FLOPs on a meta copy, the peak table, and tflops/mfu in the progress lines (functional and engine)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.deepspeed import initialize
from dsfunc.grad import compute_loss
from dsfunc.models.gpt import GPT, GPTConfig
from dsfunc.monitor import Monitor
from dsfunc.monitor.flops import count_flops, meta_copy
from dsfunc.monitor.peak import peak_of, peak_tflops
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

GPT_SMALL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def loss_of(model, batch):
    return compute_loss(None, model, batch)


def test_linear_flops_forward_and_backward_are_exact():
    # 2*B*in*out per Linear forward; backward: weight grads of each, input grads of all but the first layer
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    count = count_flops(model, lambda m, x: m(x).sum(), torch.randn(5, 6), samples=5)
    assert count.forward == 2 * 5 * (6 * 16 + 16 * 4)
    assert count.backward == 2 * 5 * (6 * 16 + 16 * 4) + 2 * 5 * 16 * 4
    assert count.modules == {"": count.forward, "0": 2 * 5 * 6 * 16, "2": 2 * 5 * 16 * 4}
    assert count.params[""] == 6 * 16 + 16 + 16 * 4 + 4 and count.kinds["1"] == "ReLU"
    assert count.per_sample == (count.forward + count.backward) / 5


def test_the_copy_is_on_meta_without_hooks_and_the_model_is_untouched():
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), config(micro=2, stage=3, bf16={"enabled": True}))
    skeleton = state.program.skeleton
    before = {n: (t, t.device, t.dtype, tuple(t.shape)) for n, t in skeleton.named_parameters()}
    twin = meta_copy(skeleton, torch.bfloat16, {"blocks.0.0.weight": (8, 8)})
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in twin.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in twin.modules())
    assert skeleton._forward_pre_hooks  # the run's own hooks stay on the run's module
    after = {n: (t, t.device, t.dtype, tuple(t.shape)) for n, t in skeleton.named_parameters()}
    assert after.keys() == before.keys() and all(after[n][0] is before[n][0] for n in after)
    assert after == before


def test_checkpointed_units_count_model_flops_without_the_recomputation():
    counts = []
    for policy in ("none", "units"):
        state = dsfunc.init_state(GPT(GPT_SMALL), config(micro=2, activation_checkpointing={"policy": policy}))
        idx = torch.randint(0, 64, (2, 16))
        counts.append(count_flops(state.program.skeleton, loss_of, (idx, idx), samples=2))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_gpt_counts_the_same_at_every_stage_and_near_6_n_t(stage):
    state = dsfunc.init_state(GPT(GPT_SMALL), config(micro=4, stage=stage, bf16={"enabled": True}))
    idx = torch.randint(0, 64, (4, 16))
    shapes = {a: p.shape for u in state.program.plan.units for p in u.params for a in p.aliases}
    count = count_flops(state.program.skeleton, loss_of, (idx, idx), samples=4, dtype=torch.bfloat16, shapes=shapes)
    n_matmul = sum(p.numel() for n, p in GPT(GPT_SMALL).named_parameters() if p.dim() == 2 and "wpe" not in n
                   and "wte" not in n)
    # the matrix products: 6 x (non-embedding weights + the tied head) x tokens, plus attention's two products
    head = 64 * 32
    attention = 2 * 2 * 16 * 16 * 32 * 2  # QK^T and AV, forward, per sample per layer: 2*T*T*d each
    assert count.per_sample == 6 * (n_matmul + head) * 16 + 3 * attention
    assert count.forward == 4 * (2 * (n_matmul + head) * 16 + attention)


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.float16, 756.5),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.5),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA GH200 480GB", torch.bfloat16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5),  # torch's default: no TF32 matmuls
        ("NVIDIA L40S", torch.bfloat16, 362.1),
        ("NVIDIA L4", torch.bfloat16, 121.0),
        ("NVIDIA A10G", torch.bfloat16, None),  # not an A10
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_the_peak_table_matches_whole_names(name, dtype, peak):
    assert peak_of(name, dtype) == peak


def test_tf32_halves_the_16_bit_peak():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert peak_of("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(989.4 / 2)
    finally:
        torch.set_float32_matmul_precision(before)
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None


def progress(lines):
    return [line for line in lines if " step=" in line]


def value(line, key):
    return float(re.search(rf"{key}=([-\d.e+]+)", line).group(1))


def test_functional_lines_carry_tflops_and_mfu_against_the_given_peak():
    cfg = config(micro=2, gas=2, steps_per_print=2, flops_profiler={"peak_tflops": 1e-6})
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), cfg)
    lines: list[str] = []
    monitor = Monitor(state, write=lines.append)
    for batch in mlp_batches(6, 4):
        state = dsfunc.train_step(state, batch)
        monitor.log(state, batch)
    monitor.close()
    said = [line for line in lines if "model FLOPs per sample" in line]
    per_sample = 2 * (6 * 8 + 3 * 8 * 8 + 8 * 4) + 2 * (2 * (6 * 8 + 3 * 8 * 8 + 8 * 4) - 6 * 8)
    assert len(said) == 1 and f"model FLOPs per sample: {per_sample} " in said[0]
    assert "mfu against 1e-06 TFLOP/s per device (cpu, fp32, given)" in said[0]
    count = monitor.utilisation.count
    for line in progress(lines):
        tflops = value(line, "tflops")
        assert tflops == pytest.approx(per_sample * value(line, "CurrSamplesPerSec") / 1e12, rel=2e-3)
        assert value(line, "mfu") == pytest.approx(100 * tflops / 1e-6, rel=2e-3)
    assert monitor.utilisation.count is count  # counted once


def test_on_the_cpu_without_a_peak_there_is_tflops_but_no_mfu():
    state = dsfunc.init_state(MLP(), config(micro=2, steps_per_print=1))
    lines: list[str] = []
    monitor = Monitor(state, write=lines.append)
    for batch in mlp_batches(2, 2):
        state = dsfunc.train_step(state, batch)
        monitor.log(state, batch)
    assert any('no peak FLOP/s known for cpu: tflops without mfu (set "flops_profiler": {"peak_tflops"' in line
               for line in lines)
    assert all("tflops=" in line and "mfu=" not in line for line in progress(lines))


def test_a_model_that_cannot_run_on_meta_says_so_once_and_trains_on():
    class Picky(MLP):
        def forward(self, x, y):
            kept = x[x.abs() < 1e9]  # a shape that depends on the values: impossible on meta tensors
            return super().forward(x, y) + 0 * kept.sum()

    state = dsfunc.init_state(Picky(), config(micro=2, steps_per_print=1))
    lines: list[str] = []
    monitor = Monitor(state, write=lines.append)
    for batch in mlp_batches(3, 2):
        state = dsfunc.train_step(state, batch)
        monitor.log(state, batch)
    failed = [line for line in lines if "model FLOPs not counted" in line]
    assert len(failed) == 1 and "failed on a meta copy" in failed[0]
    assert len(progress(lines)) == 3 and not any("tflops" in line for line in progress(lines))


def test_a_hugging_face_model_with_an_attention_mask_counts_exactly():
    """transformers reads attention_mask.all() before choosing its mask: values read as 1 during the count."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    state = dsfunc.init_state(transformers.GPT2LMHeadModel(cfg), config(micro=2, stage=3, bf16={"enabled": True}))
    ids = torch.randint(0, 100, (2, 16))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    shapes = {a: p.shape for u in state.program.plan.units for p in u.params for a in p.aliases}
    count = count_flops(state.program.skeleton, loss_of, batch, samples=2, dtype=torch.bfloat16, shapes=shapes)
    matmul = 2 * (32 * 96 + 32 * 32 + 2 * 32 * 128) + 100 * 32  # two blocks' weights and the tied head
    attention = 2 * 2 * (2 * 16 * 16 * 32)  # QK^T and AV of two layers, per sample
    assert count.forward == 2 * (2 * matmul * 16 + attention)


def test_the_engine_line_has_tflops_from_its_first_forward(capsys):
    torch.manual_seed(0)
    net = MLP()
    cfg = config(micro=2, gas=2, stage=3, steps_per_print=2, flops_profiler={"peak_tflops": 1e-6})
    engine, *_ = initialize(model=net, model_parameters=net.parameters(), config=cfg)
    for x, y in mlp_batches(8, 2):  # 4 optimizer steps
        engine.backward(engine(x, y))
        engine.step()
    out = capsys.readouterr().out
    assert "[dsfunc] model FLOPs per sample: 1536 " in out
    assert len(re.findall(r"tflops=[\d.e+-]+, mfu=[\d.]+%", out)) == 2


def _zero3_rank(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), config(micro=2, world=world_size, stage=3, steps_per_print=2))
    lines: list[str] = []
    monitor = Monitor(state, write=lines.append)
    for batch in mlp_batches(4, 2, seed=rank):
        state = dsfunc.train_step(state, batch)
        monitor.log(state, batch)
    monitor.close()
    return lines


def test_rank_0_alone_counts_at_zero_3_on_two_ranks():
    lines = run_world(_zero3_rank, 2)
    assert lines[1] == []
    assert sum("model FLOPs per sample: 1536 " in line for line in lines[0]) == 1
    assert len([line for line in progress(lines[0]) if "tflops=" in line]) == 2
