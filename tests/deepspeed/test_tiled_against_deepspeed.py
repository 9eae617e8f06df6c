"""ALST's tiled compute (``deepspeed.runtime.sequence_parallel.ulysses_sp``) under dsfunc gives real DeepSpeed
0.19.8's outputs and gradients: one script, run under each."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "deepspeed", "scripts", "tiled_compare.py")


def run(out: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "DSFUNC_AS_DEEPSPEED"}
    environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
    proc = subprocess.run([sys.executable, SCRIPT, out], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_tiled_mlp_and_losses_equal_deepspeeds(tmp_path):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    theirs = run(str(tmp_path / "deepspeed.pt"))
    ours = run(str(tmp_path / "dsfunc.pt"), DSFUNC_AS_DEEPSPEED="1")
    assert sorted(ours) == sorted(theirs) == ["logits_mean", "logits_sum", "mlp", "sequence"]
    for key, expected in theirs.items():
        for i, (got, want) in enumerate(zip(ours[key], expected, strict=True)):
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, (key, i)
