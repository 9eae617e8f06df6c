"""The examples run as a user runs them: as scripts, alone and through the launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import free_port

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], timeout: float = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_gpt_example_lowers_the_loss_on_one_process():
    out = run([sys.executable, "examples/gpt/train.py", "--steps", "60"])
    assert "world size 1, ZeRO stage 1" in out
    first, last = (float(x) for x in out.split("done: loss ")[1].split(" in ")[0].split(" -> "))
    assert last < first - 1.0


def test_gpt_example_through_the_launcher_on_two_ranks():
    out = run([sys.executable, "-m", "dsfunc.cli", "--num_gpus", "2", "--master_port", "29611",
               "examples/gpt/train.py", "--steps", "40"])
    assert "world size 2" in out and "done: loss" in out


def launched(script: str, *args: str) -> str:
    """``script`` through the launcher on two CPU ranks, with its own ds_config.json."""
    folder = os.path.dirname(script)
    return run([sys.executable, "-m", "dsfunc.cli", "--num_gpus", "2", "--master_port", str(free_port()), script,
                "--deepspeed_config", os.path.join(folder, "ds_config.json"), *args])


def test_bert_masked_lm_example_with_param_groups_and_zero3(tmp_path):
    pytest.importorskip("transformers")
    out = launched("examples/bert_mlm/train.py", "--epochs", "2", "--output_dir", str(tmp_path))
    assert "weight decay per group [0.01, 0.0]" in out and "ZeRO stage 3 over 2 rank(s)" in out
    before, after = (float(x) for x in re.search(r"accuracy on \d+ held-out windows: ([\d.]+) % -> ([\d.]+) %",
                                                 out).groups())
    reloaded = float(re.search(r"reloaded from .*: masked-word accuracy ([\d.]+) %", out).group(1))
    assert after > before + 3 and reloaded == after  # the saved 16-bit weights are the trained module's


def test_two_engine_gan_example():
    out = launched("examples/gan/train.py")
    near, covered = re.search(r"samples near a mode: [\d.]+ % -> ([\d.]+) %; modes covered: \d/8 -> (\d)/8",
                              out).groups()
    assert float(near) > 30 and int(covered) >= 5
