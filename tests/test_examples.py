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
GPT = "examples/gpt/train.py"


def run(args: list[str], timeout: float = 240) -> str:
    # this checkout's dsfunc: `python examples/...` puts the script's folder first on sys.path, not the checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def val_losses(out: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step +(\d+)  val loss ([\d.]+)", out, re.MULTILINE)}


def test_gpt_example_trains_evaluates_samples_and_resumes_exactly(tmp_path):
    """The README's main job: the training and held-out losses fall, a sample and a checkpoint are written
    (and said where), and a run stopped at step 30 and resumed with --resume ends exactly as one that was not."""
    straight = run([sys.executable, GPT, "--steps", "60", "--eval_interval", "30", "--out_dir", str(tmp_path / "a")])
    assert "world size 1, ZeRO stage 1" in straight
    first, last = (float(x) for x in re.search(r"done: loss ([\d.]+) -> ([\d.]+)", straight).groups())
    assert last < first - 1.0
    val = val_losses(straight)
    assert sorted(val) == [30, 60] and float(val[60]) < float(val[30]) < first
    sample = (tmp_path / "a" / "sample.txt").read_text()
    assert len(sample) > 200 and sample.startswith("The ") and sample.strip() in straight
    assert (tmp_path / "a" / "ckpt" / "latest").read_text() == "global_step60"
    assert f"wrote {tmp_path / 'a' / 'ckpt'} (continue with --resume) and {tmp_path / 'a' / 'sample.txt'}" in straight

    run([sys.executable, GPT, "--steps", "30", "--eval_interval", "30", "--out_dir", str(tmp_path / "b")])
    resumed = run([sys.executable, GPT, "--steps", "60", "--eval_interval", "30", "--out_dir", str(tmp_path / "b"),
                   "--resume"])
    assert f"resumed from {tmp_path / 'b' / 'ckpt'} at step 30" in resumed
    assert val_losses(resumed) == {60: val[60]}
    step60 = re.compile(r"^step   60  loss .*?grad_norm [\d.]+", re.MULTILINE)
    assert step60.search(resumed).group() == step60.search(straight).group()


def test_gpt_example_through_the_launcher_on_two_ranks(tmp_path):
    out = run([sys.executable, "-m", "dsfunc.cli", "--num_gpus", "2", "--master_port", str(free_port()), GPT, "--steps", "40",
               "--out_dir", str(tmp_path)])
    assert "world size 2" in out and "done: loss" in out and sorted(val_losses(out)) == [40]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step40"


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
