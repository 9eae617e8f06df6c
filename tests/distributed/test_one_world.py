"""The functional API joins the world a launcher describes: the README's Quickstart under ``dsfunc --num_gpus 2``
trains one model; a state, or a save, in a world that disagrees with the environment is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import dsfunc
from dsfunc.errors import UsageError
from tests.launcher.scripts.harness import REPO, cli_env, free_port, run_dsfunc

SCRIPT = REPO / "tests" / "distributed" / "quickstart_rank.py"
CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.mark.parametrize("stage", [0, 3])
def test_readme_quickstart_under_the_launcher_trains_one_model(tmp_path, stage):
    proc = run_dsfunc(["--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT), "--stage", str(stage),
                       "--out", str(tmp_path)], REPO, cli_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [(r["world"], r["rank"], r["env_rank"]) for r in ranks] == [(2, 0, 0), (2, 1, 1)]
    first, second = (r["params"] for r in ranks)
    assert first.keys() == second.keys() and len(first) > 0
    assert all(torch.equal(first[k], second[k]) for k in first)  # one model, not two


def _python(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    full = cli_env(tmp_path, **env)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=300, check=False)


def test_a_group_of_another_size_than_the_environment_is_refused(tmp_path):
    """A script that made a one-process group of its own while the launcher says WORLD_SIZE=2."""
    code = (
        "import torch, torch.distributed as dist, dsfunc\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "try:\n"
        f"    dsfunc.init_state(torch.nn.Linear(2, 2), {CONFIG!r})\n"
        "except dsfunc.Error as e:\n"
        "    print(type(e).__name__, e)\n"
        "dist.destroy_process_group()\n"
    )
    proc = _python(code, tmp_path, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UsageError the training state runs in a world of 1 process(es)" in proc.stdout, proc.stdout
    assert "WORLD_SIZE=2" in proc.stdout


def test_a_save_from_a_state_of_another_world_is_refused(tmp_path, monkeypatch):
    """Ranks that each built a world-size-1 state while the launcher says 2 would overwrite each other's save."""
    for key in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    state = dsfunc.init_state(nn.Linear(2, 2), CONFIG)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"save_checkpoint's state runs in a world of 1 process\(es\), but the "
                                         r"launcher's environment describes 2"):
        dsfunc.save_checkpoint(state, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.delenv("WORLD_SIZE")
    dsfunc.save_checkpoint(state, tmp_path / "ckpt")  # the same state saves where no launcher says otherwise
