"""The examples run as a user runs them: as scripts, alone and through the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], timeout: float = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
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
