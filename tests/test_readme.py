"""The README's code runs as written: every ```python block, in order (the ones that continue the Quickstart in
its scope), the DeepSpeed script in a process of its own, the pipeline on 2 gloo ranks through the launcher."""

import math
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.launcher.scripts.harness import cli_env, free_port, run_dsfunc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks() -> dict[str, str]:
    """The README's python blocks by what they show (each block must be claimed by exactly one test)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    marks = {"quickstart": "text = torch.tensor(", "composition": "def loss_fn(model, batch)",
             "monitor": "dsfunc.monitor.Monitor(state)", "deepspeed": "import torch, dsfunc as deepspeed",
             "checkpoints": "dsfunc.save_checkpoint(state", "pipeline": "from dsfunc.pipeline import"}
    found = {name: [b for b in blocks if mark in b] for name, mark in marks.items()}
    assert all(len(v) == 1 for v in found.values()), {k: len(v) for k, v in found.items()}
    assert len(blocks) == len(marks), "a README python block that no test runs"
    return {name: v[0] for name, v in found.items()}


def test_quickstart_and_the_snippets_continuing_it_run(capsys, tmp_path, monkeypatch):
    blocks = python_blocks()
    monkeypatch.chdir(tmp_path)  # the checkpoint snippet writes ./ckpt
    scope: dict = {}
    torch.manual_seed(0)
    exec(blocks["quickstart"], scope)  # noqa: S102 - the README is ours
    assert int(scope["state"].step) == 40
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)$", capsys.readouterr().out, re.MULTILINE)]
    assert len(losses) == 4 and losses[-1] < math.log(256) - 1.5, losses  # trains visibly, well below chance
    exec(blocks["composition"], scope)  # noqa: S102
    assert int(scope["state"].step) == 1
    assert scope["state"].metrics.lr.item() == 0.0  # WarmupLR's first step, from the transform's schedule
    exec(blocks["monitor"], scope)  # noqa: S102
    out = capsys.readouterr().out
    assert "[dsfunc] ZeRO stage 3 over 1 rank(s)" in out
    lines = re.findall(r"^\[dsfunc\] step=(\d+), skipped=0, loss=[\d.]+, .*TokensPerSec=", out, re.MULTILINE)
    assert lines == ["10", "20"], out  # every steps_per_print (10) steps
    exec(blocks["checkpoints"], scope)  # noqa: S102
    assert int(scope["state"].step) == 21 and scope["client_state"] == {"epoch": 3}
    assert (tmp_path / "ckpt" / "global_step21").is_dir()


def test_deepspeed_script_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-c", python_blocks()["deepspeed"]], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step8"  # 256 samples / batch 32


def test_pipeline_runs_on_two_ranks(tmp_path):
    script = tmp_path / "pipe.py"
    script.write_text(python_blocks()["pipeline"])
    proc = run_dsfunc(["--num_gpus", "2", "--master_port", str(free_port()), str(script)], tmp_path,
                      cli_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = dict(re.findall(r"rank (\d): loss (\d+\.\d{3})", proc.stdout))  # the ranks' lines may interleave
    assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"], proc.stdout  # the whole model's loss
    assert math.isfinite(float(losses["0"]))
