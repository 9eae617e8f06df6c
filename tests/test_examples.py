"""The examples run as a user runs them: as scripts, alone and through the launcher."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import free_port

ROOT = Path(__file__).resolve().parents[1]
GPT = "examples/gpt/train.py"


def start(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # this checkout's dsfunc: `python examples/...` puts the script's folder first on sys.path, not the checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def run(args: list[str], timeout: float = 240) -> str:
    proc = start(args, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr  # all a person sees


def val_losses(out: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step +(\d+)  val loss ([\d.]+)", out, re.MULTILINE)}


def step_line(out: str, step: int) -> str:
    """The progress line of ``step`` up to its grad norm (tokens/s is a rate, different every run)."""
    return re.search(rf"^step +{step}  loss .*?grad_norm [\d.]+", out, re.MULTILINE).group()


def loss_at(out: str, step: int) -> float:
    return float(re.search(r"loss ([\d.]+)", step_line(out, step)).group(1))


def gpt(out_dir: Path, steps: int, *args: str) -> str:
    return run([sys.executable, GPT, "--steps", str(steps), "--eval_interval", "30", "--out_dir", str(out_dir), *args])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 60-step run: its folder and its output."""
    out_dir = tmp_path_factory.mktemp("straight")
    return out_dir, gpt(out_dir, 60)


def test_gpt_example_trains_evaluates_and_samples(straight):
    """The README's main job: the training and held-out losses fall, a sample and a checkpoint are written
    (and said where)."""
    out_dir, out = straight
    assert "world size 1, ZeRO stage 1" in out and '"total_num_steps": 60' in out  # the schedule spans --steps
    assert "no effect in dsfunc" not in out  # the example passes its config on as written, adding no keys
    first, last = (float(x) for x in re.search(r"done: loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 1.0
    val = val_losses(out)
    assert sorted(val) == [30, 60] and float(val[60]) < float(val[30]) < first
    sample = (out_dir / "sample.txt").read_text()
    assert len(sample) > 200 and sample.startswith("The ") and sample.strip() in out
    assert (out_dir / "ckpt" / "latest").read_text() == "global_step60"
    assert (f"wrote {out_dir / 'ckpt'} (continue with --resume and a larger --steps) and {out_dir / 'sample.txt'}"
            in out)


def test_gpt_example_resumed_with_the_same_steps_ends_exactly_as_the_uninterrupted_run(straight, tmp_path):
    """A run that stopped after its step-30 checkpoint (its ``latest`` names global_step30) and is resumed with
    the same --steps trains steps 31-60 bit for bit as the run that did not stop: the batches are a function of
    the step, the schedule of the step and --steps."""
    out_dir, out = straight
    shutil.copytree(out_dir / "ckpt" / "global_step30", tmp_path / "ckpt" / "global_step30")
    (tmp_path / "ckpt" / "latest").write_text("global_step30")
    resumed = gpt(tmp_path, 60, "--resume")
    assert f"resumed from {tmp_path / 'ckpt'} at step 30 (val loss {val_losses(out)[30]})" in resumed
    assert val_losses(resumed) == {60: val_losses(out)[60]}
    assert step_line(resumed, 31) and step_line(resumed, 60) == step_line(out, 60)
    assert (tmp_path / "sample.txt").read_text() == (out_dir / "sample.txt").read_text()


def test_gpt_example_resume_with_more_steps_continues_the_run(straight, tmp_path):
    """--resume --steps 60 after a 45-step run trains steps 46-60 from where the loss was, on the 60-step
    schedule (a checkpoint of a 45-step schedule loads into a 60-step one). Not bitwise the uninterrupted run:
    steps 31-45 (after the 30 warmup steps) followed the 45-step decay. A --steps not beyond the saved step
    says so."""
    first_part = gpt(tmp_path, 45)
    assert '"total_num_steps": 45' in first_part
    resumed = gpt(tmp_path, 60, "--resume")
    assert f"resumed from {tmp_path / 'ckpt'} at step 45 (val loss {val_losses(first_part)[45]})" in resumed
    assert '"total_num_steps": 60' in resumed and (tmp_path / "ckpt" / "latest").read_text() == "global_step60"
    assert re.findall(r"^step +(\d+)  loss", resumed, re.MULTILINE) == ["46", "50", "60"]
    _, out = straight
    assert loss_at(resumed, 46) < loss_at(out, 1) - 1.0  # continues: not the untrained model's loss again
    assert abs(loss_at(resumed, 46) - loss_at(first_part, 45)) < 0.3  # the next batch on the same weights
    assert float(val_losses(resumed)[60]) < float(val_losses(first_part)[45])
    lr = re.compile(r"lr ([\d.e+-]+)")
    for step in (50, 60):  # the schedule is a function of the step and --steps alone
        assert lr.search(step_line(resumed, step)).group(1) == lr.search(step_line(out, step)).group(1)
    assert val_losses(resumed)[60] != val_losses(out)[60]

    again = start([sys.executable, GPT, "--steps", "40", "--out_dir", str(tmp_path), "--resume"], timeout=240)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert (f"nothing to do: the run is at step 60 (the checkpoint in {tmp_path / 'ckpt'}) and --steps 40 is the "
            "last step to train; pass a --steps beyond 60 to train on") in again.stderr


def test_gpt_example_through_the_launcher_on_two_ranks(tmp_path):
    out = run([sys.executable, "-m", "dsfunc.cli", "--num_gpus", "2", "--master_port", str(free_port()), GPT, "--steps", "30",
               "--out_dir", str(tmp_path)])  # the fewest steps: the schedule warms up for 30
    assert "world size 2" in out and "done: loss" in out and sorted(val_losses(out)) == [30]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step30"


def launched(script: str, *args: str) -> str:
    """``script`` through the launcher on two CPU ranks, with its own ds_config.json."""
    folder = os.path.dirname(script)
    return run([sys.executable, "-m", "dsfunc.cli", "--num_gpus", "2", "--master_port", str(free_port()), script,
                "--deepspeed_config", os.path.join(folder, "ds_config.json"), *args])


def test_bert_masked_lm_example_with_param_groups_and_zero3(tmp_path):
    pytest.importorskip("transformers")
    out = launched("examples/bert_mlm/train.py", "--epochs", "1", "--output_dir", str(tmp_path))
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
