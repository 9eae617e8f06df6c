"""The flops_profiler section's profile, and DeepSpeed's get_model_profile / FlopsProfiler against real DeepSpeed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.deepspeed import initialize
from dsfunc.monitor import Monitor
from dsfunc.monitor.flops_profiler import FlopsProfiler, get_model_profile
from dsfunc.monitor.profile import number_to_string, params_to_string
from tests.models import MLP, config, mlp_batches

ROOT = str(Path(__file__).resolve().parents[2])
MLP_FWD = 2 * 2 * (6 * 8 + 3 * 8 * 8 + 8 * 4)  # one micro-batch of 2 samples


def run(cfg: dict, steps: int) -> list[str]:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), cfg)
    lines: list[str] = []
    monitor = Monitor(state, write=lines.append)
    for batch in mlp_batches(steps, cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]):
        state = dsfunc.train_step(state, batch)
        monitor.log(state, batch)
    monitor.close()
    return lines


def test_the_profile_follows_the_step_that_starts_at_profile_step(tmp_path):
    out = tmp_path / "prof" / "flops.txt"
    cfg = config(micro=2, gas=2, steps_per_print=None,
                 flops_profiler={"enabled": True, "profile_step": 2, "top_modules": 2, "output_file": str(out)})
    lines = run(cfg, 2)
    assert not out.exists() and not lines  # the third step is the profiled one
    run(cfg, 3)
    text = out.read_text()
    words = " ".join(text.split())
    assert "Profile Summary at step 3:" in text
    assert f"fwd flops per rank: {number_to_string(MLP_FWD)}" in words
    assert f"fwd MACs per rank: {number_to_string(MLP_FWD // 2)}MACs" in words
    assert f"bwd flops per rank (counted): {number_to_string(2 * MLP_FWD - 2 * 2 * 6 * 8)}" in words
    assert "FLOPS per rank = fwd+bwd flops x 2 micro-batch(es) / iter latency:" in text
    assert "depth 1:\n    params      - {'ModuleList': '216', 'Linear': '92'}" in text
    assert "    MACs        - {'Linear': '160 MACs', 'ModuleList': '0 MACs'}" in text
    rows = [line for line in text.splitlines() if "(Linear)" in line or line.startswith("MLP ")]
    assert len(rows) == 1 + 2 + 3 and rows[0].split()[1:3] == ["308", "100.00%"]
    # each module's forward timed in the profiled step: latency, its share of the model's, FLOP/s
    assert all(re.search(r"s +[\d.]+% +[\d.]+ [KMGT]?FLOPS$", row) for row in rows), rows
    assert re.search(r"MLP .* 100\.00% +[\d.]+ [KMGT]?FLOPS$", rows[0])
    assert "    fwd latency - {'MLP': " in text


def test_module_depth_and_detailed_limit_what_is_printed():
    cfg = config(micro=2, steps_per_print=None,
                 flops_profiler={"enabled": True, "profile_step": 0, "module_depth": 1, "detailed": True})
    text = "\n".join(run(cfg, 1))
    assert "  blocks (ModuleList)" in text and "    0 (Sequential)" not in text
    assert "depth 1:" in text and "depth 2:" not in text
    cfg["flops_profiler"]["detailed"] = False
    text = "\n".join(run(cfg, 1))
    assert "Profile Summary at step 1:" in text and "Per module" not in text


def test_the_engine_prints_the_profile_with_its_timings(capsys):
    torch.manual_seed(0)
    net = MLP()
    cfg = config(micro=2, steps_per_print=None, wall_clock_breakdown=True,
                 flops_profiler={"enabled": True, "profile_step": 1, "detailed": False})
    engine, *_ = initialize(model=net, model_parameters=net.parameters(), config=cfg)
    for x, y in mlp_batches(3, 2):
        engine.backward(engine(x, y))
        engine.step()
    out = capsys.readouterr().out
    assert out.count("Profile Summary at step 2:") == 1
    for name in ("fwd latency:", "bwd latency:", "step latency:", "iter latency"):
        assert name in out


def test_get_model_profile_counts_one_forward_as_deepspeed_writes_it(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    flops, macs, params = get_model_profile(model, input_shape=(8, 64), print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * 8 * 2 * 64 * 256, 8 * 2 * 64 * 256, 2 * 64 * 256 + 256 + 64)
    assert get_model_profile(model, args=[torch.ones(8, 64)], print_profile=False) == ("524.29 K", "262.14 KMACs",
                                                                                       "33.09 K")
    get_model_profile(model, kwargs={"input": torch.ones(8, 64)}, detailed=False, top_modules=3)
    out = capsys.readouterr().out
    assert "fwd latency:" in out and "{'Linear': '262.14 KMACs', 'GELU': '0 MACs'}" in out
    with pytest.raises(ValueError, match="give input_shape, or the model's inputs"):
        get_model_profile(model)
    assert params_to_string(1.5e9) == "1.5 B"


def test_flops_profiler_counts_the_forwards_between_start_and_stop(tmp_path):
    model = nn.Linear(10, 20)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.ones(3, 10))
    model(torch.ones(3, 10))
    prof.stop_profile()
    model(torch.ones(3, 10))  # not counted
    assert prof.get_total_flops() == 2 * 2 * 3 * 10 * 20 and prof.get_total_macs() == 2 * 3 * 10 * 20
    assert prof.get_total_params(as_string=True) == "220" and prof.get_total_duration() > 0
    prof.print_model_profile(output_file=str(tmp_path / "p.txt"))
    assert "fwd flops per rank:" in (tmp_path / "p.txt").read_text()
    prof.end_profile()


COMPARE = """
import json, sys, torch
from torch import nn
sys.path.insert(0, {root!r})
from dsfunc.models.gpt import GPT, GPTConfig
if sys.argv[1] == "deepspeed":
    from deepspeed.profiling.flops_profiler import get_model_profile
else:
    from dsfunc.monitor.flops_profiler import get_model_profile
torch.manual_seed(0)
models = {{
    "mlp": (nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 10)),
            dict(input_shape=(8, 64))),
    "gpt": (GPT(GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=128)),
            dict(args=[torch.randint(0, 512, (4, 64))])),
    "conv": (nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.Flatten(), nn.Linear(1152, 10)),
             dict(input_shape=(2, 3, 16, 16))),
}}
print(json.dumps({{k: get_model_profile(m, print_profile=False, as_string=False, **kw) for k, (m, kw) in models.items()}}))
"""


def test_get_model_profile_agrees_with_real_deepspeed():
    """DeepSpeed also counts elementwise work (GELU, LayerNorm, ReLU, softmax) that torch's counter leaves out:
    MACs and parameters agree exactly, FLOPs within 2% on these models."""
    results = {}
    for impl in ("deepspeed", "dsfunc"):
        proc = subprocess.run([sys.executable, "-c", COMPARE.format(root=ROOT), impl], check=False, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (flops, macs, params) in results["dsfunc"].items():
        ds_flops, ds_macs, ds_params = results["deepspeed"][name]
        assert (macs, params) == (ds_macs, ds_params), name
        assert flops <= ds_flops <= 1.02 * flops, name


def test_deepspeed_scripts_import_the_profiler_by_its_path():
    code = ("from deepspeed.profiling.flops_profiler import get_model_profile, FlopsProfiler\n"
            "from deepspeed.profiling.flops_profiler.profiler import number_to_string\n"
            "import dsfunc.monitor.flops_profiler as mine\n"
            "assert get_model_profile is mine.get_model_profile and number_to_string(2.5e9) == '2.5 G'\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DSFUNC_AS_DEEPSPEED": "1", "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_module_timer_times_forwards_of_the_model_only_and_leaves_no_hook():
    from torch.utils.checkpoint import checkpoint

    from dsfunc.monitor.timing import ModuleTimer

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    model = Checkpointed()
    timer = ModuleTimer(model, torch.device("cpu"))
    calls = []
    model.inner[0].register_forward_hook(lambda *_: calls.append(1))
    for _ in range(2):
        model(torch.ones(2, 4, requires_grad=True)).sum().backward()  # the backward runs inner's forward again
    assert len(calls) == 4 and timer.forwards == 2
    seconds = timer.remove()
    assert set(seconds) == {"", "inner", "inner.0", "inner.1"} and all(s > 0 for s in seconds.values())
    assert seconds[""] >= seconds["inner"] >= seconds["inner.0"]
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
